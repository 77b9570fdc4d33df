"""Per-block distillation statistics of the sweep banks (held-out MSE zero-shot -> distilled, the
epoch kept, head-grouping report), read from each block file's header, as JSON. The banks
themselves are large and not committed; this summary is::

    python experiments/bank_stats.py results/spd_sweep_tp3 results/spd_sweep_tp2 results/spd_sweep_tp3_hg
"""

from __future__ import annotations

import sys
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, provenance
from syncdrop.spd.checkpoint import read_block_meta


def main(argv: list[str]) -> int:
    for d in map(Path, argv):
        banks = {}
        for bank in sorted(d.glob("bank_*")):
            rows = []
            for f in sorted((bank / "blocks").glob("*.safetensors")):
                m = read_block_meta(f)
                st = m["stats"]
                rows.append({"block": m["layer"], "tier": m["tier"], "heldout_mse_zero_shot": st["heldout_loss_zs"],
                             "heldout_mse_distilled": st["heldout_loss"], "heldout_curve": st["heldout_curve"],
                             "head_grouping": st.get("head_grouping")})
            banks[bank.name.removeprefix("bank_")] = rows
        atomic_write_json(d / "bank_stats.json", {"banks": banks, "provenance": provenance()})
        print(f"wrote {d / 'bank_stats.json'} ({', '.join(f'{k}: {len(v)} blocks' for k, v in banks.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
