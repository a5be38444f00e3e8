"""Chat prompts and tool calling.

* :mod:`kk_jax.chat.encoders`: the :class:`~kk_jax.chat.encoders.ChatEncoder` interface and its
  implementations (checkpoint jinja templates for Qwen3 / GLM-5.3 / others, the DeepSeek V4.1
  Python encoder), chosen from the checkpoint config by ``chat_encoder_for``.
* :mod:`kk_jax.chat.deepseek_v41`: the byte-exact DS4.1 prompt encoder.
* :mod:`kk_jax.chat.tool_parsers`: streaming/whole parsers of DSML, GLM and Hermes tool calls.
* :mod:`kk_jax.chat.tool_names`: tool namespaces (``ns::name``).
* :mod:`kk_jax.chat.openai_tools`: validation of the OpenAI ``tools`` / ``tool_choice`` fields.
* :mod:`kk_jax.chat.template`: the sandboxed jinja renderer.
"""
