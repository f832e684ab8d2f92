"""weights/tensor_codec.py: torch.dtype and torch.Size inside collective_rpc values
(OpenRLHF's `update_weight(name, torch.bfloat16, shape, ...)`) cross msgpack as
themselves, never pickled; a peer's unknown dtype name or oversized Size is refused by
name. References: torch's own dtype attributes and the values sent."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pagellm.weights.tensor_codec import (
    DTYPE_EXT,
    DTYPE_NAMES,
    MAX_SIZE_DIMS,
    SIZE_EXT,
    decode_value,
    encode_value,
)


def wire(value: object) -> object:
    """Through msgpack bytes, as between processes."""
    return decode_value(msgspec.msgpack.decode(msgspec.msgpack.encode(encode_value(value))))


def test_dtypes_and_sizes_come_back_as_themselves_wherever_they_sit():
    value = [torch.bfloat16, torch.Size([4096, 11008]),
             {"dtype": torch.float16, "shape": torch.Size([]), "nested": (torch.Size([-1, 3]),)},
             ("w", torch.int64, torch.tensor([1, 2]))]
    got = wire(value)
    assert got[0] is torch.bfloat16
    assert type(got[1]) is torch.Size and got[1] == torch.Size([4096, 11008])
    assert got[2]["dtype"] is torch.float16
    assert type(got[2]["shape"]) is torch.Size and got[2]["shape"] == torch.Size([])
    assert type(got[2]["nested"][0]) is torch.Size and got[2]["nested"][0] == (-1, 3)
    assert got[3][:2] == ["w", torch.int64]  # a tuple comes back as a list, as before
    assert torch.equal(got[3][2], torch.tensor([1, 2]))


@pytest.mark.parametrize("name", sorted(DTYPE_NAMES))
def test_every_dtype_in_the_table_is_torchs_own(name):
    assert wire(getattr(torch, name)) is getattr(torch, name)


def test_a_dtype_outside_the_table_is_refused_before_sending():
    with pytest.raises(TypeError, match=r"torch\.quint8 cannot be sent"):
        encode_value(torch.quint8)


@pytest.mark.parametrize(("payload", "why"), [
    ("__class__", r"unknown torch\.dtype '__class__'"),  # never getattr(torch, name)
    ("Tensor", r"unknown torch\.dtype 'Tensor'"),
    (3, r"malformed torch\.dtype"),
])
def test_a_peers_unknown_dtype_name_is_refused(payload, why):
    ext = msgspec.msgpack.Ext(DTYPE_EXT, msgspec.msgpack.encode(payload))
    with pytest.raises(ValueError, match=why):
        decode_value([ext])


@pytest.mark.parametrize("dims", [[1] * (MAX_SIZE_DIMS + 1), [2**63 - 1], ["a"], {"a": 1}])
def test_a_peers_oversized_or_malformed_size_is_refused(dims):
    ext = msgspec.msgpack.Ext(SIZE_EXT, msgspec.msgpack.encode(dims))
    with pytest.raises(ValueError, match=r"bad torch\.Size"):
        decode_value({"shape": ext})


def test_a_size_past_the_bounds_is_refused_before_sending():
    with pytest.raises(ValueError, match=r"bad torch\.Size"):
        encode_value(torch.Size([1] * (MAX_SIZE_DIMS + 1)))
    assert wire(torch.Size([1] * MAX_SIZE_DIMS)) == torch.Size([1] * MAX_SIZE_DIMS)


def test_an_unknown_extension_code_is_refused():
    with pytest.raises(ValueError, match="unknown msgpack extension type 9"):
        decode_value(msgspec.msgpack.Ext(9, b""))
