"""The compressed sync point: an all-reduce whose wire carries a low-bit format (:mod:`syncdrop.plan.wire`).

It keeps its sync point (every rank ends with the same sum) and may stand at either point of a block,
so it also carries the SPD block's one remaining sync point (``{"attn": "drop", "mlp": {"wire":
"int8"}}``: ``X_out = X + TwoStep(P_r + Z_r) + b_o + b_down``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from syncdrop.errors import SyncdropError
from syncdrop.plan.base import Collectives, SyncMode, add_bias
from syncdrop.plan.wire import DEFAULT_GROUP, WireFormat

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Compressed(SyncMode):
    """``X + TwoStep_wire(Y_r) + b``: the two-step all-reduce of :meth:`WireFormat.two_step`, the wire
    format ``wire`` (``bf16``, ``fp8``, ``int8``, ``int4``) in groups of ``group`` channels.

    In training the sum's gradient is the plain all-reduce's (a straight-through estimator: the
    rounding is treated as the identity), see the communicators' ``compressed_all_reduce``."""

    wire: str = "int8"
    group: int = DEFAULT_GROUP
    name: ClassVar[str] = "compressed"

    def __post_init__(self) -> None:
        self.codec  # noqa: B018  (validates the format and the group size)

    @property
    def codec(self) -> WireFormat:
        return WireFormat(self.wire, self.group)

    def payload(self, hidden: int) -> float:
        return 1.0  # every channel travels (in fewer bytes: :meth:`wire_bytes`)

    def wire_bytes(self, tokens: int, hidden: int, element_size: int) -> int:
        """The encoded ``(M, h)`` partial each rank hands to the exchange (values and scales); the
        gather then carries as many again, in the same ring terms as an all-reduce's two halves."""
        return self.codec.encoded_bytes(tokens * hidden)

    def check(self, hidden: int) -> None:
        self.codec.check(hidden)

    def to_json(self) -> Any:
        d: dict[str, Any] = {"wire": self.wire}
        if self.group != DEFAULT_GROUP:
            d["group"] = self.group
        return d

    def __str__(self) -> str:
        return str(self.codec)

    def reduce(self, comm: Collectives, y: torch.Tensor, x: torch.Tensor, *biases: torch.Tensor | None) -> torch.Tensor:
        if y.shape[-1] % self.group:
            raise SyncdropError(f"wire group size {self.group} does not divide the hidden size {y.shape[-1]}")
        return add_bias(x + comm.compressed_all_reduce(y, self.codec), *biases)


def parse_compressed(v: dict[str, Any], where: str) -> Compressed:
    """``{"wire": "int8", "group": 64}`` -> :class:`Compressed`, errors naming ``where``."""
    try:
        return Compressed(v["wire"], v.get("group", DEFAULT_GROUP))
    except SyncdropError as e:
        raise SyncdropError(f"{where}: {e.message}") from None
