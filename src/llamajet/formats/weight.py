"""Weight: the one weight type — a tensor's name, kind, storage format, logical
shape and raw bytes.

The kind says what a tensor is to the model, from the architecture's tensor
spec (model/spec.py), never from its name: a MATRIX (a projection or the LM
head) may be quantized; an EMBEDDING table is a matrix read by rows (and the
LM head when tied); NORM and BIAS vectors stay fp32; a TABLE is a constant the
graph builder makes (RoPE cos/sin).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from llamajet import ops
from llamajet.errors import ModelFormatError
from llamajet.formats.layout import BlockFormat, Format, get_format


class Kind(enum.Enum):
    MATRIX = "matrix"
    EMBEDDING = "embedding"
    NORM = "norm"
    BIAS = "bias"
    TABLE = "table"

    @property
    def quantizable(self) -> bool:
        """Matrices and embedding tables take a packed scheme; vectors and tables stay float."""
        return self in (Kind.MATRIX, Kind.EMBEDDING)


@dataclass(frozen=True, eq=False)  # eq=False: equality of ndarrays is not a bool
class Weight:
    name: str                  # canonical, e.g. "blk.3.attn_q"
    kind: Kind
    format: Format             # how `data` is stored (formats/layout.py)
    shape: tuple[int, ...]     # logical: matrices [N_out, K_in], embeddings [vocab, hidden], vectors [n]
    data: np.ndarray           # raw storage: format.storage_shape(shape), format.np_dtype
    # GGUF attn_q / attn_k rows of Llama are in llama.cpp's interleaved RoPE
    # order: within each head, dims (2i, 2i+1) form a rotated pair (HF: (i, i +
    # head_dim/2)). The model picks the matching RoPE variant; q.k is unchanged
    # by the permutation.
    rope_interleaved: bool = False
    # formats/pending.py: bytes not written yet (a GGUF matrix repacked once,
    # into its final buffer, after the fusion passes stacked it)
    pending: object = None
    # formats/saved.py: a part of a fused tensor saved whole (the QKV stack, the
    # gate/up tiles): (that tensor's storage, its layout, this part's index, the
    # number of parts). formats/stack.py then takes the whole as the stack: no copy.
    stacked: tuple | None = None

    def __post_init__(self):
        if isinstance(self.format, str):
            object.__setattr__(self, "format", get_format(self.format))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        f = self.format
        if self.data.dtype != f.np_dtype:
            raise ModelFormatError(f"{self.name}: {f.name} data must be {np.dtype(f.np_dtype)}, got {self.data.dtype}")
        try:
            want = f.storage_shape(self.shape)
        except ValueError as e:
            raise ModelFormatError(f"{self.name}: {e}") from None
        if tuple(self.data.shape) != tuple(want):
            raise ModelFormatError(f"{self.name}: storage shape {tuple(self.data.shape)} does not hold a "
                                   f"{f.name} tensor of shape {self.shape} (expected {tuple(want)})")

    @property
    def packed(self) -> bool:
        return self.format.packed

    @property
    def code(self) -> ops.DType:  # the kernels' storage type
        return self.format.code

    @property
    def dtype(self) -> str:  # its name: f32 | f16 | bf16 | q8_0 | q4_0 | ... | q6_k | pk_i4s | pk_i4a | ... | pk_q6k
        if isinstance(self.format, BlockFormat) and not self.format.native:
            return self.format.name  # a GGUF block type held until repacked (no C++ storage type)
        return ops.dtype_name(self.format.code)

    @property
    def group(self) -> int:  # packed: elements per scale group along K; else 0
        return self.format.group_for(self.shape[-1])

    @property
    def scheme(self):  # packed: the QuantScheme
        if not self.packed:
            raise AttributeError(f"{self.name} is not packed ({self.format.name})")
        return self.format

    def to_f32(self) -> np.ndarray:
        """A float32 copy of shape ``shape`` (for references, tests and re-quantization)."""
        if self.pending is not None:
            self.pending.run()  # the bytes first (formats/pending.py)
        return self.format.to_f32(self.data, self.shape)

    def with_data(self, name: str, fmt, shape, data, rope_interleaved: bool | None = None) -> "Weight":
        """A weight of the same kind with other storage."""
        ri = self.rope_interleaved if rope_interleaved is None else rope_interleaved
        return Weight(name, self.kind, fmt, tuple(shape), data, ri)


def float_weight(name: str, kind: Kind, data: np.ndarray) -> Weight:
    """An fp32 weight holding `data` (copied only if it is not contiguous fp32)."""
    a = np.ascontiguousarray(data, dtype=np.float32)
    return Weight(name, kind, get_format("f32"), a.shape, a)
