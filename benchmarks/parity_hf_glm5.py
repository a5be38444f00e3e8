"""GLM-5.3 parity with Hugging Face transformers (not part of CI: needs torch).

Writes tiny glm5_next checkpoints with make_tiny, runs greedy decoding in transformers'
``Glm5NextForConditionalGeneration`` (one interpreter, with torch) and in kk_jax (another,
with jax), and compares the tokens. Prompts are long enough (> index_topk = 8 tokens) for the
pooled indexer to select sparsely.

    python benchmarks/parity_hf_glm5.py --make-ckpts ROOT
    TORCH_PY benchmarks/parity_hf_glm5.py --side hf --ckpt-root ROOT --out hf.json
    python benchmarks/parity_hf_glm5.py --side kk_jax --ckpt-root ROOT --out kk.json
    python benchmarks/parity_hf_glm5.py --compare hf.json kk.json

Also checks that transformers loads our checkpoint with no missing text-tower tensors and
that what its ``save_pretrained`` writes loads in kk_jax (``--side kk_jax`` on ROOT/hf_saved).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STEPS = 24
CASES = {"seed0": dict(seed=0), "seed1_topk16": dict(seed=1, index_topk=16),
         "l4": dict(seed=2, num_layers=4, first_dense_layers=1)}     # the CI fixture's model
PROMPTS = [[5, 17, 300, 42, 7, 99, 123, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
           list(range(100, 141)), [7, 8, 9]]


def make(root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from checkpoints.make_tiny import make_tiny

    for name, kw in CASES.items():
        make_tiny(root / name, arch="glm5_next", dtype="float32", **kw)


def side_hf(root: Path) -> dict:
    import torch
    from transformers import Glm5NextForConditionalGeneration

    out = {}
    for name in CASES:
        model, info = Glm5NextForConditionalGeneration.from_pretrained(root / name, output_loading_info=True,
                                                                       dtype=torch.float32)
        missing = [k for k in info["missing_keys"] if not k.startswith("model.visual.")]
        assert not missing and not info["mismatched_keys"], (missing, info["mismatched_keys"])
        toks = []
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
            toks.append(gen[0, len(p):].tolist())
        out[name] = toks
        if name == "seed0":
            model.save_pretrained(root / "hf_saved")
            (root / "hf_saved").joinpath("tokenizer.json").write_bytes((root / name / "tokenizer.json").read_bytes())
    return out


def side_kk(root: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kk_jax import LLM, SamplingParams

    out = {}
    names = list(CASES) + (["hf_saved"] if (root / "hf_saved").is_dir() else [])
    for name in names:
        llm = LLM(root / name, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                  progress=False)
        res = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
        out[name] = [r.token_ids for r in res]
    if "hf_saved" in out:
        assert out["hf_saved"] == out["seed0"], "kk_jax on the save_pretrained copy differs from our checkpoint"
        del out["hf_saved"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-ckpts", type=Path)
    ap.add_argument("--side", choices=["hf", "kk_jax"])
    ap.add_argument("--ckpt-root", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path)
    a = ap.parse_args()
    if a.make_ckpts:
        make(a.make_ckpts)
    if a.side:
        res = side_hf(a.ckpt_root) if a.side == "hf" else side_kk(a.ckpt_root)
        a.out.write_text(json.dumps(res))
        print(json.dumps(res))
    if a.compare:
        x, y = (json.loads(p.read_text()) for p in a.compare)
        same = {k: [i == j for i, j in zip(x[k], y[k])] for k in x}
        print(json.dumps(same))
        if not all(all(v) for v in same.values()):
            raise SystemExit(f"greedy tokens differ: {same}")
        print(f"identical greedy tokens ({STEPS} steps) for {sum(len(v) for v in same.values())} prompt/checkpoint pairs")


if __name__ == "__main__":
    main()
