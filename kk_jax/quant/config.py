"""Which quantization a checkpoint uses, and which of its linears it applies to.

Recognised (anything else that declares quantization is an error, never silently ignored):

* **Block FP8** (DeepSeek-V3 / GLM-5.3 release): ``config.json`` ``quantization_config``
  ``{"quant_method": "fp8", "weight_block_size": [bn, bk], "fmt": "e4m3",
  "activation_scheme": "dynamic"}``. The release lists no exclusions but keeps some linears
  in BF16 (GLM-5.3: ``kv_b_proj``, gates, low-rank and indexer projections), so a linear is
  block FP8 exactly when the checkpoint holds its ``weight_scale_inv`` (and it is not named by
  ``modules_to_not_convert`` / ``ignored_layers`` when those are given).
* **ModelOpt MXFP8 / NVFP4**: ``hf_quant_config.json``
  ``{"quantization": {"quant_algo": "MXFP8" | "NVFP4", "group_size", "exclude_modules": [...]}}``
  and/or ``config.json`` ``quantization_config`` ``{"quant_method": "modelopt", "quant_algo",
  "ignore": [...]}`` (or the same with a nested ``"quantization"`` dict). When both are present
  they must name the same algorithm; their exclusion lists are merged. A linear is quantized
  unless an exclusion pattern matches its module name (``fnmatch`` wildcards, the exact name,
  or a parent module's name: ``model.layers.0.self_attn`` excludes its projections). A
  quantized linear whose tensors are missing or of the wrong dtype is a checkpoint error that
  names the tensor.

Output heads (modules named ``lm_head``) are never quantized: models read their weight
directly for fp32 logits, and neither release format quantizes them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path
from typing import Any, Iterable

from kk_jax.config import ConfigError, read_json

METHODS = ("fp8_block", "mxfp8", "nvfp4")
MODELOPT_ALGOS = {"MXFP8": "mxfp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4"}
GROUP_SIZES = {"mxfp8": 32, "nvfp4": 16}
NEVER_QUANTIZED = ("lm_head",)

# Tensors a method may have next to ``weight`` and its scales, declared only when the checkpoint has them.
OPTIONAL_TENSORS = {"fp8_block": (), "mxfp8": (), "nvfp4": ("input_scale",)}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization.

    method     ``fp8_block`` | ``mxfp8`` | ``nvfp4``
    block      (bn, bk) for fp8_block; (1, group) for the ModelOpt formats
    exclude    module-name patterns left unquantized
    by_tensors fp8_block: a linear is quantized iff its ``weight_scale_inv`` is in the checkpoint
    activation_scheme  fp8_block's declared activation handling ("dynamic" = the release's
               reference quantizes activations per 1x128 group); informational, see Linear
    source     where it was read from, for messages
    """

    method: str
    block: tuple[int, int]
    exclude: tuple[str, ...] = ()
    by_tensors: bool = False
    activation_scheme: str | None = None
    source: str = ""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"unknown quantization method {self.method!r}; supported: {', '.join(METHODS)}")

    def is_excluded(self, module: str) -> bool:
        """True if ``module`` (e.g. ``model.layers.0.self_attn.q_proj``) stays unquantized."""
        return module.rsplit(".", 1)[-1] in NEVER_QUANTIZED or any(matches(p, module) for p in self.exclude)

    def method_for(self, module: str, tensor_names: Iterable[str] | None = None) -> str | None:
        """The method that applies to linear ``module``, or None if it stays in floating point.
        ``tensor_names`` (the checkpoint's tensor names) decides block-FP8 membership."""
        if self.is_excluded(module):
            return None
        if self.by_tensors and tensor_names is not None:
            return self.method if f"{module}.weight_scale_inv" in tensor_names else None
        return self.method

    def to_hf(self) -> tuple[dict, dict | None]:
        """(config.json ``quantization_config``, ``hf_quant_config.json`` or None) as written by
        the release tools: block FP8 like DeepSeek/GLM, ModelOpt like ``modelopt`` export."""
        if self.method == "fp8_block":
            qc = {"activation_scheme": self.activation_scheme or "dynamic", "fmt": "e4m3",
                  "quant_method": "fp8", "weight_block_size": list(self.block)}
            if self.exclude:
                qc["modules_to_not_convert"] = list(self.exclude)
            return qc, None
        algo = {"mxfp8": "MXFP8", "nvfp4": "NVFP4"}[self.method]
        group = GROUP_SIZES[self.method]
        hf_quant = {"producer": {"name": "modelopt", "version": "kk_jax-quantize"},
                    "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": group,
                                     "exclude_modules": list(self.exclude)}}
        qc = {"quant_method": "modelopt", "quant_algo": algo, "group_size": group, "ignore": list(self.exclude),
              "producer": hf_quant["producer"]}
        return qc, hf_quant


def _modelopt_algo(d: dict) -> tuple[str | None, list[str], Any]:
    """(quant_algo, exclusions, group_size) from either ModelOpt spelling."""
    inner = d.get("quantization") if isinstance(d.get("quantization"), dict) else d
    algo = inner.get("quant_algo")
    exclude = [p for lst in (inner.get("exclude_modules"), inner.get("ignore"), d.get("ignore"))
               for p in _patterns(lst or [], "exclude_modules/ignore")]
    exclude = list(dict.fromkeys(exclude))              # every list given, in order, once
    return (str(algo).upper() if algo else None), exclude, inner.get("group_size")


def _patterns(exclude, key: str) -> list[str]:
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError(f"{key} must be a list of module-name patterns, got {exclude!r}")
    return exclude


def _modelopt(algo: str | None, exclude: list[str], group: Any, source: str) -> QuantConfig:
    if not algo:
        raise ConfigError(f"{source} declares ModelOpt quantization but gives no quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise ConfigError(f"unsupported quant_algo {algo!r} in {source}; supported: MXFP8, NVFP4 (ModelOpt) and "
                          "block FP8 (quant_method 'fp8' with weight_block_size)")
    method = MODELOPT_ALGOS[algo]
    if group is not None and (not isinstance(group, (int, str)) or not str(group).isdigit()
                              or int(group) != GROUP_SIZES[method]):
        raise ConfigError(f"{source}: {algo} uses group_size {GROUP_SIZES[method]}, got {group}")
    return QuantConfig(method, (1, GROUP_SIZES[method]), tuple(exclude), source=source)


def parse(config: dict, hf_quant: dict | None, where: str = "") -> QuantConfig | None:
    """QuantConfig from a parsed config.json and hf_quant_config.json (either may lack it)."""
    for name, doc in (("config.json", config), ("hf_quant_config.json", hf_quant)):
        if doc is not None and not isinstance(doc, dict):
            raise ConfigError(f"{where}{name} must be a JSON object, got {type(doc).__name__}")
    qc = config.get("quantization_config")
    from_config = None
    algo_elsewhere = None        # config.json says ModelOpt, its exclusions, and leaves quant_algo to the file
    if qc is not None:
        if not isinstance(qc, dict):
            raise ConfigError(f"{where}config.json quantization_config must be an object, got {type(qc).__name__}")
        method = str(qc.get("quant_method", "")).lower()
        if method == "fp8":
            block = qc.get("weight_block_size")
            if block is None:
                raise ConfigError(f"{where}config.json declares quant_method 'fp8' without weight_block_size; only "
                                  "block FP8 is supported (per-tensor FP8 is not)")
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                                  for b in block)):
                raise ConfigError(f"{where}config.json weight_block_size must be two positive ints, got {block!r}")
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ConfigError(f"{where}config.json block FP8 fmt {fmt!r} is not supported (only e4m3)")
            scale_fmt = qc.get("scale_fmt")
            if scale_fmt not in (None, "ue8m0", "float"):
                raise ConfigError(f"{where}config.json block FP8 scale_fmt {scale_fmt!r} is not supported")
            exclude = _patterns(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [],
                                f"{where}config.json modules_to_not_convert")
            from_config = QuantConfig("fp8_block", tuple(block), tuple(exclude), by_tensors=True,
                                      activation_scheme=qc.get("activation_scheme"),
                                      source=f"{where}config.json")
        elif method.startswith("modelopt"):
            algo, exclude, group = _modelopt_algo(qc)
            if algo is None and hf_quant is not None:
                algo_elsewhere = exclude
            else:
                from_config = _modelopt(algo, exclude, group, source=f"{where}config.json quantization_config")
        else:
            raise ConfigError(f"{where}config.json declares quant_method {qc.get('quant_method')!r}, which is not "
                              "supported; supported: 'fp8' with weight_block_size (block FP8) and 'modelopt' "
                              "(MXFP8, NVFP4)")
    from_file = None
    if hf_quant is not None:
        algo, exclude, group = _modelopt_algo(hf_quant)
        if algo is None and from_config is None:
            raise ConfigError(f"{where}hf_quant_config.json has no quantization.quant_algo")
        if algo is not None:
            from_file = _modelopt(algo, exclude, group, source=f"{where}hf_quant_config.json")
        elif exclude:                   # the file only adds exclusions to config.json's method
            from_config = dataclasses.replace(
                from_config, exclude=tuple(dict.fromkeys(from_config.exclude + tuple(exclude))),
                source=f"{from_config.source} + {where}hf_quant_config.json")
    if algo_elsewhere is not None:      # (from_file is set: a file without quant_algo raised above)
        from_file = dataclasses.replace(
            from_file, exclude=tuple(dict.fromkeys(from_file.exclude + tuple(algo_elsewhere))),
            source=f"{from_file.source} + {where}config.json")
    if from_config is not None and from_file is not None:
        if from_config.method != from_file.method:
            raise ConfigError(f"{where}config.json quantization_config says {from_config.method} but "
                              f"hf_quant_config.json says {from_file.method}")
        merged = tuple(dict.fromkeys(from_config.exclude + from_file.exclude))
        return dataclasses.replace(from_file, exclude=merged,
                                   source=f"{from_file.source} + {from_config.source}")
    return from_config or from_file


def matches(pattern: str, module: str) -> bool:
    """Whether an exclusion pattern names ``module``: the exact name, a parent module
    (``model.layers.0``) or an ``fnmatch`` wildcard pattern of the module or of a parent
    (``model.layers.*.self_attn`` names every layer's attention projections)."""
    return (module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)
            or fnmatch.fnmatchcase(module, pattern + ".*"))


def detect(model_dir: str | Path) -> QuantConfig | None:
    """QuantConfig of an HF checkpoint directory, or None if its weights are not quantized."""
    model_dir = Path(model_dir)
    cfg_path, hq_path = model_dir / "config.json", model_dir / "hf_quant_config.json"
    config, hf_quant = read_json(cfg_path, {}), read_json(hq_path)
    return parse(config, hf_quant, where=f"{model_dir}/")


def detect_with_names(model_dir) -> tuple[QuantConfig | None, set[str] | None]:
    """(:func:`detect` of ``model_dir`` or None for no directory, the checkpoint's tensor names
    when it is quantized): the names decide block-FP8 membership and which optional tensors
    (NVFP4's ``input_scale``) the layers declare. Names are None when the checkpoint is not
    quantized or its files are missing or unreadable (the loader reports those)."""
    qcfg = detect(model_dir) if model_dir is not None else None
    if qcfg is None:
        return None, None
    from kk_jax.checkpoint.safetensors_io import SafetensorsError, index_checkpoint

    try:
        return qcfg, set(index_checkpoint(model_dir))
    except (FileNotFoundError, SafetensorsError):
        return qcfg, None
