"""``syncdrop export``: write a model and its plan as a transformers directory that vLLM serves."""

from __future__ import annotations

import argparse

from syncdrop.cli_args import MODEL_HELP, at_least
from syncdrop.plan import PLAN_SPEC_HELP


def cmd_export(args: argparse.Namespace) -> int:
    from syncdrop.serve.export import export_model

    at_least(args, 1, "tp")
    res = export_model(args.model, args.tp, args.out, args.plan, force=args.force, progress=not args.quiet,
                       dtype=args.dtype, max_shard_size=args.max_shard_size)
    files = f"{len(res.files)} shards" if len(res.files) > 1 else res.files[0]
    print(f"wrote {res.out} ({res.bytes_written / 2**20:.0f} MB of {res.dtype} weights, {files}): "
          f"{res.architecture}, TP={res.tp}, plan {res.plan.summary()}"
          + (f"; distilled blocks {res.distilled_blocks}" if res.distilled_blocks else "")
          + (f"; head grouping baked into blocks {res.permuted_blocks}" if res.permuted_blocks else ""))
    print(f"serve it: vllm serve {res.out} --tensor-parallel-size {res.tp}"
          + ("  (the syncdrop vLLM plugin must be installed: pip install syncdrop)" if not res.plan.is_dense else ""))
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a model and its sync plan as a transformers directory for vLLM")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP + " | a `syncdrop distill` directory")
    p.add_argument("--tp", type=int, required=True, help="the tensor-parallel degree it will be served at")
    p.add_argument("--plan", default=None, help=f"sync plan: {PLAN_SPEC_HELP} (default: the model's own plan, "
                   "else none)")
    p.add_argument("--dtype", default="auto",
                   help="float32 | bfloat16 | float16 | auto (default: the source's; float32 for a GGUF, whose "
                        "quantised weights dequantise to float32)")
    p.add_argument("--max-shard-size", default=None,
                   help="largest weight file, as transformers' max_shard_size (default 5GB, "
                        "syncdrop.models.hf_writer.DEFAULT_MAX_SHARD_SIZE; e.g. 500MB, or bytes): a larger model "
                        "is split into model-0000i-of-0000N.safetensors with model.safetensors.index.json")
    p.add_argument("--out", required=True, help="output directory (new or empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)
