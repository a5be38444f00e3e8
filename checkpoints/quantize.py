"""Write a quantized copy of a bf16 / f32 Hugging Face checkpoint.

    python checkpoints/quantize.py --in DIR --out DIR --algo fp8_block|mxfp8|nvfp4 [--exclude PATTERN ...]

Every linear projection of the model (the ``Linear`` layers kk_jax builds for the
checkpoint's architecture, its MTP block included, and each routed expert's
``experts.{e}.{gate,up,down}_proj``, as the GLM-5.3 release quantizes them; output heads named
``lm_head`` always stay in floating point) is quantized unless a ``--exclude`` pattern matches
its module name (``fnmatch`` wildcards, the exact name, or a parent module such as
``model.layers.0``; a pattern that names no module is an error) or the architecture's release
keeps it in floating point (``RELEASE_FLOAT``: for GLM-5.3 ``kv_b_proj``, the KDA gate and
low-rank projections, the indexer and ``eh_proj``). Everything else (embeddings,
norms, tokenizer files, generation config) is copied unchanged. The result has exactly the
tensors and config entries the public releases have:

* ``fp8_block``: ``X.weight`` e4m3 + ``X.weight_scale_inv`` f32 ``[ceil(N/128), ceil(K/128)]``;
  ``config.json`` ``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme:
  dynamic, weight_block_size: [128, 128]}`` (+ ``modules_to_not_convert`` with the excludes).
* ``mxfp8``: ``X.weight`` e4m3 + ``X.weight_scale`` uint8 E8M0 ``[N, K/32]``;
  ``hf_quant_config.json`` (``quant_algo: MXFP8``, ``exclude_modules``) and the matching
  ``quantization_config`` (``quant_method: modelopt``) in ``config.json``.
* ``nvfp4``: ``X.weight`` uint8 ``[N, K/2]`` + ``X.weight_scale`` e4m3 ``[N, K/16]`` +
  ``X.weight_scale_2`` f32 ``[]`` (no ``input_scale``: there is no activation calibration).

Scale rules: ``kk_jax.quant.{fp8_block,mxfp8,nvfp4}`` (ModelOpt's for the ModelOpt formats).
The safetensors files keep the input's file names and split; the index is rewritten.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):                      # python checkpoints/quantize.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ALGOS = ("fp8_block", "mxfp8", "nvfp4")           # kk_jax.quant.config.METHODS (not imported for --help)

# Linears an architecture's official release keeps in floating point (fnmatch patterns over
# module names); they stay in floating point here too, whatever the format. GLM-5.3's block-FP8
# release quantizes the experts (routed and shared), dense MLPs, KDA q/k/v/o and MLA
# q_a/q_b/kv_a/o_proj, and keeps kv_b_proj (read directly for MLA weight absorption), the KDA
# gate and low-rank projections, the indexer and the MTP eh_proj in BF16.
RELEASE_FLOAT = {
    "Glm5NextForConditionalGeneration": (
        "*.self_attn.kv_b_proj", "*.self_attn.b_proj", "*.self_attn.f_a_proj", "*.self_attn.f_b_proj",
        "*.self_attn.g_a_proj", "*.self_attn.g_b_proj", "*.self_attn.indexer.*", "*.eh_proj"),
}


class QuantizeError(ValueError):
    """The input cannot be quantized as asked; the message says what to change."""


def release_float(model_dir: Path) -> tuple[str, ...]:
    """The :data:`RELEASE_FLOAT` patterns of the checkpoint's architecture (none for Qwen3)."""
    from kk_jax.config import load_model_config

    return RELEASE_FLOAT.get(load_model_config(model_dir).architecture, ())


def linear_modules(model_dir: Path) -> list[str]:
    """Names of the Linear modules kk_jax builds for this checkpoint (with the MTP block, for
    architectures that have one: the engine loads it on request), and of every routed expert's
    projections (``...mlp.experts.{e}.{gate,up,down}_proj``: stacked params with ``hf_experts``
    metadata, stored per expert in the checkpoint)."""
    import jax.numpy as jnp
    from flax import nnx

    from kk_jax.config import load_model_config
    from kk_jax.models.layers.linear import Linear
    from kk_jax.models.registry import model_class

    cfg = load_model_config(model_dir)
    cls = model_class(cfg.architecture)
    extra = {"mtp": True} if getattr(cls, "has_mtp", False) else {}
    model = nnx.eval_shape(lambda: cls(cfg, jnp.bfloat16, **extra))
    names = [".".join(map(str, path)) for path, module in nnx.iter_modules(model) if isinstance(module, Linear)]
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        spec = var.get_metadata().get("hf_experts")
        if spec is not None:
            base = ".".join(map(str, path[:-1]))
            names += [f"{base}.{e}.{spec[0]}" for e in range(spec[1])]
    return names


def quantize_tensor(algo: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """{suffix: array} replacing ``weight`` for one [N, K] float weight."""
    import jax.numpy as jnp

    from kk_jax.quant import fp8_block, mxfp8, nvfp4

    w = jnp.asarray(np.asarray(w, np.float32))
    if algo == "fp8_block":
        q, s = fp8_block.quantize(w)
        return {"weight": np.asarray(q), "weight_scale_inv": np.asarray(s, np.float32)}
    if algo == "mxfp8":
        q, s = mxfp8.quantize(w)
        return {"weight": np.asarray(q), "weight_scale": np.asarray(s, np.uint8)}
    q, s, s2 = nvfp4.quantize(w)
    return {"weight": np.asarray(q, np.uint8), "weight_scale": np.asarray(s),
            "weight_scale_2": np.asarray(s2, np.float32).reshape(())}


def quantize_checkpoint(src, dst, algo: str, exclude: list[str] | tuple = (), progress: bool = False) -> Path:
    """Writes the quantized copy of ``src`` into ``dst`` (created; must not be ``src``)."""
    from safetensors.numpy import save

    from kk_jax.checkpoint.safetensors_io import LazyTensor, index_checkpoint
    from kk_jax.quant.config import GROUP_SIZES, QuantConfig, detect, matches

    src, dst = Path(src), Path(dst)
    if algo not in ALGOS:
        raise QuantizeError(f"--algo must be one of {', '.join(ALGOS)}, got {algo!r}")
    if not (src / "config.json").is_file():
        raise QuantizeError(f"--in {src} is not a Hugging Face checkpoint directory (no config.json)")
    if src.resolve() == dst.resolve():
        raise QuantizeError("--out must differ from --in")
    if dst.exists() and not dst.is_dir():
        raise QuantizeError(f"--out {dst} exists and is not a directory")
    if detect(src) is not None:
        raise QuantizeError(f"{src} is already quantized; start from a bf16/f32 checkpoint")
    block = (128, 128) if algo == "fp8_block" else (1, GROUP_SIZES[algo])
    keep = release_float(src)
    # block FP8 marks quantized linears by their scale tensors (the release lists no exclusions);
    # the ModelOpt formats must name every linear left in floating point
    written = tuple(exclude) if algo == "fp8_block" else tuple(dict.fromkeys((*exclude, *keep)))
    qcfg = QuantConfig(algo, block, written, activation_scheme="dynamic" if algo == "fp8_block" else None)
    chooser = QuantConfig(algo, block, tuple(exclude) + keep)
    tensors = index_checkpoint(src)
    linears = linear_modules(src)
    modules = [m for m in linears if f"{m}.weight" in tensors]
    targets = {m for m in modules if chooser.method_for(m)}
    if not modules:
        problems = [f"none of the model's linear weights is in the checkpoint (e.g. {linears[0]}.weight; "
                    f"it has {sorted(tensors)[:3]}...): its tensor names do not follow the architecture's"]
    else:
        problems = [f"--exclude {p!r} matches no linear module (e.g. {modules[0]})" for p in exclude
                    if not any(matches(p, m) for m in modules)]
    if not targets and not problems:
        problems.append("every linear module is excluded: nothing to quantize")
    for m in sorted(targets):
        info = tensors[f"{m}.weight"]
        if info.dtype not in ("F32", "BF16", "F16"):
            problems.append(f"{m}.weight has dtype {info.dtype}; quantize a bf16/f32 checkpoint")
        k = info.shape[-1]
        need = GROUP_SIZES.get(algo, 1)
        if k % need:
            problems.append(f"{m}.weight has in_features {k}, not a multiple of {need} ({algo}); "
                            f"add --exclude {m}")
    if problems:
        raise QuantizeError("cannot quantize:\n  " + "\n  ".join(problems))

    dst.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for name, info in tensors.items():
        by_file.setdefault(info.file.name, []).append(name)
    # the files are written under temporary names and replace what ``dst`` held only once all
    # are written: a weight found unfit half way (inf / NaN) leaves ``dst`` as it was
    partial = {fname: dst / f".{fname}.partial" for fname in by_file}
    weight_map, total = {}, 0
    try:
        for fname, names in sorted(by_file.items()):
            out: dict[str, np.ndarray] = {}
            for name in sorted(names, key=lambda n: tensors[n].start):
                arr = LazyTensor(tensors[name])[...]
                module, _, suffix = name.rpartition(".")
                if suffix == "weight" and module in targets:
                    w32 = arr.astype(np.float32)                  # one copy, checked and quantized
                    if not np.isfinite(w32).all():
                        raise QuantizeError(f"{name} holds inf or NaN values, which no scale can represent; "
                                            f"fix the checkpoint or add --exclude {module}")
                    for sfx, q in quantize_tensor(algo, w32).items():
                        out[f"{module}.{sfx}"] = np.array(q, order="C")        # keeps 0-d scalars 0-d
                    if progress:
                        print(f"  {module}: {algo}", file=sys.stderr)
                else:
                    out[name] = np.array(arr, order="C")
            partial[fname].write_bytes(save(out, metadata={"format": "pt"}))
            weight_map.update({n: fname for n in out})
            total += sum(a.nbytes for a in out.values())
    except BaseException:
        for p in partial.values():
            p.unlink(missing_ok=True)
        raise
    for old in list(dst.glob("*.safetensors")) + [dst / "model.safetensors.index.json"]:
        if old.is_file():
            old.unlink()
    for fname, p in partial.items():
        p.rename(dst / fname)
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    for p in src.iterdir():                              # tokenizer, generation config, templates, ...
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (
                "config.json", "model.safetensors.index.json", "hf_quant_config.json"):
            shutil.copy2(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    qc, hf_quant = qcfg.to_hf()
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2, sort_keys=True) + "\n")
    elif (dst / "hf_quant_config.json").is_file():
        (dst / "hf_quant_config.json").unlink()
    return dst


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in", dest="src", required=True, help="bf16/f32 HF checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--algo", required=True, choices=ALGOS)
    ap.add_argument("--exclude", action="extend", nargs="+", default=[], metavar="PATTERN",
                    help="module-name patterns to keep in floating point (fnmatch, exact or parent names); "
                         "may be repeated")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    from kk_jax.checkpoint.safetensors_io import SafetensorsError
    from kk_jax.config import ConfigError

    try:
        out = quantize_checkpoint(args.src, args.out, args.algo, args.exclude, progress=not args.quiet)
    except (QuantizeError, ConfigError, SafetensorsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.algo} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
