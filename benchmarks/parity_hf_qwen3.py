"""Qwen3 parity: Hugging Face transformers vs the NumPy oracle vs kk_jax, on tiny checkpoints.

Not part of CI (transformers and torch are not project dependencies). Each side reads the same
make_tiny checkpoints, tokenizes the same prompts, decodes greedily (no stop on EOS) and writes
a JSON file; ``--compare`` then checks that prompt ids and greedy tokens are equal and reports
the logits' max relative error (max |a - b| / max |b|, teacher-forced on the prompt).

Cases (all run in float32): ``tied`` (default sizes, tied embeddings), ``untied`` (3 layers,
separate lm_head, seed 1), ``tied_bf16file`` (weights stored in bfloat16, upcast on load, so
the bf16 readers are compared too).

The sides can run in different interpreters (transformers wants its own environment, kk_jax
needs Python 3.12 + jax), so the work is split:

    python benchmarks/parity_hf_qwen3.py --make-ckpts ROOT                     # any side's interpreter
    python benchmarks/parity_hf_qwen3.py --side hf     --ckpt-root ROOT --out hf.json
    python benchmarks/parity_hf_qwen3.py --side numpy  --ckpt-root ROOT --out numpy.json
    python benchmarks/parity_hf_qwen3.py --side kk_jax --ckpt-root ROOT --out kk.json
    python benchmarks/parity_hf_qwen3.py --compare hf.json numpy.json [--compare kk.json numpy.json]

With no --side / --compare it does everything possible in the current interpreter (checkpoints
in a temporary folder, every importable side, every pair compared) and exits non-zero on any
mismatch. Each side records sha256 digests of the checkpoint files it read, and --compare
checks both sides read identical checkpoints.

The hf side also checks the checkpoint layout: the model loads with no missing, unexpected or
mismatched keys, and what ``save_pretrained`` writes back has the same tensor names, shapes,
dtypes and config / generation_config keys as make_tiny's files (differences are listed).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "tied": dict(seed=0, dtype="float32", tie_word_embeddings=True),
    "untied": dict(seed=1, dtype="float32", tie_word_embeddings=False, num_layers=3),
    "tied_bf16file": dict(seed=2, dtype="bfloat16", tie_word_embeddings=True),
}

# Prompts: ("chat", messages) are rendered with the checkpoint's chat template and
# add_generation_prompt=True; ("text", str) are encoded as plain text.
PROMPTS = {
    "chat": ("chat", [{"role": "user", "content": "What is the capital of France?"}]),
    "chat_system": (
        "chat",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Give me a simple recipe for pancakes."},
        ],
    ),
    "text": ("text", "The train leaves at 9:30 from platform 4, and"),
    "one_token": ("text", "a"),
}

REL_TOL = 1e-4  # float32 logits: max |a - b| / max |b|


# ----------------------------------------------------------------------------- helpers


def _import_make_tiny():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from checkpoints.make_tiny import make_tiny

    return make_tiny


def _import_oracle():
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from oracles import qwen3_numpy

    return qwen3_numpy


def make_ckpts(root: Path) -> dict[str, Path]:
    """Write every case's checkpoint under ``root/<case>``; returns case -> directory."""
    make_tiny = _import_make_tiny()
    return {name: make_tiny(root / name, arch="qwen3", **kw) for name, kw in CASES.items()}


def _digests(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir()) if p.is_file()}


def _pack(a: np.ndarray) -> dict:
    """Exact, compact JSON encoding of a float32 array (base64 of little-endian bytes)."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "f32_b64": base64.b64encode(a.tobytes()).decode()}


def _unpack(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["f32_b64"]), dtype="<f4").reshape(d["shape"])


def _local_prompt_ids(ckpt: Path) -> dict[str, list[int]]:
    """Tokenize the prompts without transformers: tokenizers + jinja2, rendered as HF renders
    chat templates (sandboxed, trim/lstrip blocks, tojson without HTML escaping)."""
    import jinja2.sandbox
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    template = json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    out = {}
    for name, (kind, value) in PROMPTS.items():
        text = env.from_string(template).render(messages=value, add_generation_prompt=True) if kind == "chat" else value
        out[name] = tok.encode(text, add_special_tokens=False).ids
    return out


def _versions(*mods: str) -> dict[str, str]:
    import importlib

    v = {"python": platform.python_version()}
    for m in mods:
        try:
            v[m] = importlib.import_module(m).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            v[m] = f"unavailable ({type(e).__name__})"
    return v


# ----------------------------------------------------------------------------- sides


def side_numpy(ckpts: dict[str, Path], steps: int) -> dict:
    """The NumPy oracle: full recompute per step, float64 math."""
    oracle = _import_oracle()
    res = {"side": "numpy", "steps": steps, "versions": _versions("numpy", "tokenizers"), "cases": {}}
    for case, ckpt in ckpts.items():
        cfg, w = oracle.load(ckpt)
        prompts = {}
        for name, ids in _local_prompt_ids(ckpt).items():
            prompts[name] = {
                "prompt_ids": ids,
                "tokens": oracle.greedy(cfg, w, ids, steps),
                "logits": _pack(oracle.logits(cfg, w, ids)),
            }
        res["cases"][case] = {"ckpt_sha256": _digests(ckpt), "prompts": prompts}
    return res


def _safetensors_layout(d: Path) -> dict[str, list]:
    """name -> [dtype, shape] over all safetensors files of a directory (headers only)."""
    import struct

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        for k, v in json.loads(data[8 : 8 + n]).items():
            if k != "__metadata__":
                out[k] = [v["dtype"], v["shape"]]
    return out


def _dict_diff(ours: dict, theirs: dict, skip=()) -> list[str]:
    diffs = []
    for k in sorted(set(ours) | set(theirs)):
        if k in skip:
            continue
        if k not in theirs:
            diffs.append(f"{k}: only in make_tiny ({ours[k]!r})")
        elif k not in ours:
            diffs.append(f"{k}: only in transformers' save ({theirs[k]!r})")
        elif ours[k] != theirs[k]:
            diffs.append(f"{k}: make_tiny {ours[k]!r} vs transformers {theirs[k]!r}")
    return diffs


TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"}


def _hf_layout_check(model, tokenizer, ckpt: Path, tmp: Path, dtype_name: str) -> dict:
    """Save the loaded model back with transformers and diff the layout against make_tiny's.

    Strict (must be empty): weight/config file names, tensor names / dtypes / shapes, config.json
    and generation_config.json keys and values. Informational (``tokenizer_*``): transformers 5
    rewrites tokenizer files in its own format (chat template in chat_template.jinja,
    extra_special_tokens), while make_tiny writes them as the published Qwen3 checkpoints do.
    """
    import torch

    out = tmp / "resaved"
    model.to(getattr(torch, dtype_name)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    rd = lambda p: json.loads(p.read_text())  # noqa: E731
    ours, theirs = {p.name for p in ckpt.iterdir()}, {p.name for p in out.iterdir()}
    return {
        "files_only_ours": sorted(ours - theirs - TOKENIZER_FILES),
        "files_only_hf": sorted(theirs - ours - TOKENIZER_FILES),
        "tensors": _dict_diff(_safetensors_layout(ckpt), _safetensors_layout(out)),
        "config": _dict_diff(rd(ckpt / "config.json"), rd(out / "config.json")),
        "generation_config": _dict_diff(
            rd(ckpt / "generation_config.json"), rd(out / "generation_config.json"), skip=("_from_model_config",)
        ),
        "tokenizer_files": [f"only in make_tiny: {f}" for f in sorted((ours - theirs) & TOKENIZER_FILES)]
        + [f"only in transformers' save: {f}" for f in sorted((theirs - ours) & TOKENIZER_FILES)],
        "tokenizer_config": _dict_diff(
            {k: v for k, v in rd(ckpt / "tokenizer_config.json").items() if k != "chat_template"},
            {k: v for k, v in rd(out / "tokenizer_config.json").items() if k != "chat_template"},
        ),
        "tokenizer_chat_template_same": _saved_chat_template(ckpt) == _saved_chat_template(out),
    }


def _saved_chat_template(d: Path) -> str | None:
    """The chat template of a saved tokenizer: chat_template.jinja if present, else tokenizer_config's."""
    if (d / "chat_template.jinja").exists():
        return (d / "chat_template.jinja").read_text()
    return json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")


def side_hf(ckpts: dict[str, Path], steps: int) -> dict:
    """transformers: AutoModelForCausalLM in float32 (its default attention), greedy with its KV cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    res = {
        "side": "hf",
        "steps": steps,
        "versions": _versions("numpy", "torch", "transformers", "tokenizers", "safetensors"),
        "cases": {},
    }
    for case, ckpt in ckpts.items():
        model, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, f"{case}: transformers reported loading problems: {bad}"
        assert type(model).__name__ == "Qwen3ForCausalLM", type(model).__name__
        model.eval()
        tok = AutoTokenizer.from_pretrained(ckpt)
        prompts = {}
        for name, (kind, value) in PROMPTS.items():
            if kind == "chat":
                enc = tok.apply_chat_template(value, add_generation_prompt=True, tokenize=True)
                ids = enc["input_ids"] if hasattr(enc, "keys") else enc
            else:
                ids = tok(value, add_special_tokens=False)["input_ids"]
            ids = [int(i) for i in ids]
            with torch.no_grad():
                x = torch.tensor([ids])
                out = model(input_ids=x, use_cache=True)
                prompt_logits = out.logits[0].float().numpy()
                past, nxt, tokens = out.past_key_values, int(out.logits[0, -1].argmax()), []
                for _ in range(steps):
                    tokens.append(nxt)
                    out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
            prompts[name] = {"prompt_ids": ids, "tokens": tokens, "logits": _pack(prompt_logits)}
        with tempfile.TemporaryDirectory() as tmp:
            cfg_dtype = json.loads((ckpt / "config.json").read_text())["dtype"]
            layout = _hf_layout_check(model, tok, ckpt, Path(tmp), cfg_dtype)
        res["cases"][case] = {
            "ckpt_sha256": _digests(ckpt),
            "prompts": prompts,
            "loading_info": {k: list(v) for k, v in info.items()},
            "attn_implementation": model.config._attn_implementation,
            "layout": layout,
        }
        del model
    return res


def side_kk_jax(ckpts: dict[str, Path], steps: int) -> dict:
    """kk_jax's offline API: greedy (temperature 0), ignore_eos, all prompts in one batch."""
    import gc

    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # a source checkout works without installing kk_jax
    import kk_jax
    from kk_jax import LLM, SamplingParams

    res = {"side": "kk_jax", "steps": steps, "versions": _versions("numpy", "jax", "tokenizers"), "cases": {}}
    in_repo = Path(kk_jax.__file__).resolve().is_relative_to(REPO)
    res["versions"]["kk_jax"] = "this checkout" if in_repo else "another copy (not this checkout)"
    for case, ckpt in ckpts.items():
        prompt_ids = _local_prompt_ids(ckpt)
        names = list(prompt_ids)
        llm = LLM(model=str(ckpt), dtype="float32")
        outs = llm.generate(
            [prompt_ids[n] for n in names], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        )
        prompts = {n: {"prompt_ids": prompt_ids[n], "tokens": [int(t) for t in o.token_ids]} for n, o in zip(names, outs)}
        res["cases"][case] = {"ckpt_sha256": _digests(ckpt), "prompts": prompts}
        del llm, outs
        gc.collect()
    return res


SIDES = {"hf": side_hf, "numpy": side_numpy, "kk_jax": side_kk_jax}


# ----------------------------------------------------------------------------- compare


def compare(a: dict, b: dict) -> dict:
    """Compare two side results; ``b`` is the reference for relative errors."""
    rows, ok = [], True
    for case in sorted(set(a["cases"]) & set(b["cases"])):
        ca, cb = a["cases"][case], b["cases"][case]
        same_ckpt = ca["ckpt_sha256"] == cb["ckpt_sha256"]
        ok &= same_ckpt
        for name in sorted(set(ca["prompts"]) & set(cb["prompts"])):
            pa, pb = ca["prompts"][name], cb["prompts"][name]
            ta, tb = pa["tokens"], pb["tokens"]
            n = min(len(ta), len(tb))
            agree = next((i for i in range(n) if ta[i] != tb[i]), n)
            row = {
                "case": case,
                "prompt": name,
                "same_ckpt": same_ckpt,
                "prompt_ids_equal": pa["prompt_ids"] == pb["prompt_ids"],
                "prompt_len": len(pb["prompt_ids"]),
                "steps": n,
                "tokens_equal_for": agree,
                "distinct_tokens": len(set(tb)),
            }
            if "logits" in pa and "logits" in pb and row["prompt_ids_equal"]:
                la, lb = _unpack(pa["logits"]).astype(np.float64), _unpack(pb["logits"]).astype(np.float64)
                err = np.abs(la - lb)
                row["logits_max_abs_err"] = float(err.max())
                row["logits_max_rel_err"] = float(err.max() / np.abs(lb).max())
                ok &= row["logits_max_rel_err"] <= REL_TOL
            ok &= row["prompt_ids_equal"] and agree == n and len(ta) == len(tb)
            rows.append(row)
    missing = sorted(set(a["cases"]) ^ set(b["cases"]))
    ok &= not missing and bool(rows)
    return {"a": a["side"], "b": b["side"], "ok": bool(ok), "missing_cases": missing, "rows": rows}


def _print_compare(c: dict) -> None:
    print(f"\n{c['a']} vs {c['b']}: {'OK' if c['ok'] else 'MISMATCH'}")
    print(f"{'case':<14} {'prompt':<12} {'ckpt':<5} {'ids':<5} {'T':>3} {'equal/steps':>11} {'distinct':>8} {'max rel err':>12} {'max abs err':>12}")
    for r in c["rows"]:
        rel = f"{r['logits_max_rel_err']:.2e}" if "logits_max_rel_err" in r else "-"
        ab = f"{r['logits_max_abs_err']:.2e}" if "logits_max_abs_err" in r else "-"
        print(
            f"{r['case']:<14} {r['prompt']:<12} {'same' if r['same_ckpt'] else 'DIFF':<5} "
            f"{'=' if r['prompt_ids_equal'] else 'DIFF':<5} {r['prompt_len']:>3} "
            f"{r['tokens_equal_for']:>5}/{r['steps']:<5} {r['distinct_tokens']:>8} {rel:>12} {ab:>12}"
        )
    if c["missing_cases"]:
        print(f"cases present on one side only: {c['missing_cases']}")


def _print_layout(res: dict) -> bool:
    """Print the hf side's layout report; True when tensors, config and files match."""
    ok = True
    for case, c in res["cases"].items():
        lay = c.get("layout")
        if lay is None:
            continue
        strict = {k: lay[k] for k in ("files_only_ours", "files_only_hf", "tensors", "config", "generation_config")}
        if not lay["tokenizer_chat_template_same"]:
            strict["chat_template"] = ["differs after transformers' save"]
        case_ok = not any(strict.values())
        ok &= case_ok
        print(f"\nlayout {case}: {'matches transformers save_pretrained' if case_ok else 'DIFFERS'}")
        for k, v in strict.items():
            for line in v:
                print(f"  {k}: {line}")
        for k in ("tokenizer_files", "tokenizer_config"):
            for line in lay[k]:
                print(f"  (info) {k}: {line[:160]}")
    return ok


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-ckpts", metavar="ROOT", help="only write the case checkpoints under ROOT")
    ap.add_argument("--side", choices=sorted(SIDES), help="run one side and write --out")
    ap.add_argument("--ckpt-root", help="checkpoints written by --make-ckpts (default: write fresh ones to a temp dir)")
    ap.add_argument("--out", help="JSON output (a side's results, or the full report)")
    ap.add_argument("--compare", nargs=2, action="append", metavar=("A", "B"), help="compare two side JSONs (B is the reference)")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)

    if args.make_ckpts:
        for case, d in make_ckpts(Path(args.make_ckpts)).items():
            print(f"{case}: {d}")
        return 0

    if args.compare:
        results = []
        for a, b in args.compare:
            ra, rb = _load(a), _load(b)
            for r in (ra, rb):
                if r["side"] == "hf":
                    _print_layout(r)
            c = compare(ra, rb)
            _print_compare(c)
            results.append(c)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        return 0 if all(c["ok"] for c in results) else 1

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.ckpt_root) if args.ckpt_root else Path(tmp)
        ckpts = {case: root / case for case in CASES} if args.ckpt_root else make_ckpts(root)
        if args.side:
            if not args.out:
                ap.error("--side needs --out")
            res = SIDES[args.side](ckpts, args.steps)
            Path(args.out).write_text(json.dumps(res) + "\n")
            print(f"{args.side}: wrote {args.out} ({', '.join(f'{k} {v}' for k, v in res['versions'].items())})")
            return 0

        # Everything possible in this interpreter.
        results = {}
        for side, fn in SIDES.items():
            try:
                results[side] = fn(ckpts, args.steps)
            except ImportError as e:
                print(f"side {side} skipped: {e}")
        ok = True
        report = {"sides": {k: {"versions": v["versions"]} for k, v in results.items()}, "compare": []}
        if "hf" in results:
            ok &= _print_layout(results["hf"])
            report["layout"] = {case: c["layout"] for case, c in results["hf"]["cases"].items()}
        order = [s for s in ("hf", "kk_jax", "numpy") if s in results]
        for a, b in itertools.combinations(order, 2):
            c = compare(results[a], results[b])
            _print_compare(c)
            report["compare"].append(c)
            ok &= c["ok"]
        for side, r in results.items():
            print(f"versions {side}: {', '.join(f'{k} {v}' for k, v in r['versions'].items())}")
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print("\nPARITY OK" if ok and len(results) > 1 else "\nPARITY FAILED" if not ok else "\nonly one side ran")
        return 0 if ok and len(results) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
