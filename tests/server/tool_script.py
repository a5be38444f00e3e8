"""Test-only steering of a live server's model output (used by the tools API tests).

:class:`Script` wraps the server's ``ModelRunner.prefill`` / ``ModelRunner.decode_start``: the
model runs as usual, then the sampled tokens of requests whose sampling ``seed`` has a registered
script are replaced by the script's tokens (the text encoded by the checkpoint's tokenizer,
then an end token). Requests with other seeds are untouched. Nothing outside tests changes. A
decode call dispatched ahead continues from the model's own last token, not the script's; the
output stays the script's because every token of a scripted request is rewritten.
"""


class Script:
    """Scripted sampled tokens for a live server's engine, keyed by request seed."""

    def __init__(self, engine):
        self.tok, self.runner, self.eos = engine.tokenizer, engine.runner, engine.eos_token_ids[0]
        self.scripts: dict[int, list[int]] = {}
        prefill, start = self.runner.prefill, self.runner.decode_start
        self.runner.prefill = lambda rows: self._apply(rows, prefill(rows))

        def decode_start(rows, after=None):
            call = start(rows, after)
            result = call.result
            call.result = lambda: self._apply(rows, result())
            return call
        self.runner.decode_start = decode_start

    def set(self, seed: int, text: str, end: int | None = None) -> int:
        """Requests with this seed generate ``text`` and then ``end`` (default: the first EOS id)."""
        ids = self.tok.encode(text)
        assert self.tok.decode(ids) == text                   # the tiny tokenizer round-trips the script
        self.scripts[seed] = ids + [self.eos if end is None else end]
        return seed

    def _apply(self, rows, results):
        for row, res in zip(rows, results):
            ids = self.scripts.get(row.params.seed)
            if ids is not None:
                new = ids[row.token_index:row.token_index + len(res.tokens)]
                res.tokens, res.logprobs = new, res.logprobs[:len(new)]
                res.top_ids, res.top_logprobs = res.top_ids[:len(new)], res.top_logprobs[:len(new)]
        return results

    def remove(self):
        del self.runner.prefill, self.runner.decode_start
