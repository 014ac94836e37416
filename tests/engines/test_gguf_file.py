"""engines/gguf_file.py against the `gguf` package's own reader and writer.

A file written by `gguf.GGUFWriter` with every metadata type, arrays, a custom alignment and
F32 / F16 / Q8_0 tensors reads the same here as through `gguf.GGUFReader` (values, tensor
names, types, shapes and data); malformed files are ValueErrors that say where they stop.
(The default checkpoint end to end, against transformers: test_gguf.py.)
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pddgw.engines import gguf_file  # noqa: E402

Q8 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "every.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for kind, value in (("uint8", 7), ("int8", -7), ("uint16", 65535), ("int16", -300), ("uint32", 1 << 31),
                        ("int32", -(1 << 30)), ("float32", 0.1), ("uint64", 1 << 60), ("int64", -(1 << 60)),
                        ("float64", 0.1), ("bool", True), ("string", "déjà 東京")):
        getattr(w, f"add_{kind}")(f"k.{kind}", value)
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, 1.25])
    w.add_array("k.strings", ["a", "", "naïve 🚀"])
    w.add_array("k.bools", [True, False])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q8), raw_dtype=Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_the_gguf_package_reads(written):
    ours, theirs = gguf_file.read(written), gguf.GGUFReader(written, "r")
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields["k.string"] == "déjà 東京" and ours.fields["general.alignment"] == 64
    assert ours.fields["k.strings"] == ["a", "", "naïve 🚀"] and ours.fields["k.bools"] == [True, False]
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
        ("f32", gguf.GGMLQuantizationType.F32, (5, 3)), ("f16", gguf.GGMLQuantizationType.F16, (7, 2)),
        ("q8", Q8, (64, 2))]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.data.dtype, a.data.shape) == (b.tensor_type, tuple(b.shape.tolist()),
                                                                        b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data)
    assert np.array_equal(gguf.quants.dequantize(ours.tensors[2].data, Q8),
                          gguf.quants.dequantize(theirs.tensors[2].data, Q8))


def test_malformed_files_are_value_errors_that_say_where(written, tmp_path):
    good = written.read_bytes()
    bad = tmp_path / "bad.gguf"

    def error(data: bytes) -> str:
        bad.write_bytes(data)
        with pytest.raises(ValueError) as e:
            gguf_file.read(bad)
        return str(e.value)

    assert error(b"GGUX" + good[4:]) == "no GGUF magic"
    assert error(good[:4] + struct.pack("<I", 1) + good[8:]) == "GGUF version 1 unsupported (2 or 3)"
    # A count no file this size can hold is refused before anything is allocated for it.
    assert error(good[:16] + struct.pack("<Q", 1 << 40) + good[24:]).startswith(
        f"{1 << 40} items at byte 24 cannot fit in the file ({len(good)} bytes)")
    assert error(good[:10]) == "8 bytes wanted at byte 8, past the file's end (10)"       # the header
    assert re.fullmatch(r"\d+ bytes wanted at byte \d+, past the file's end \(260\)", error(good[:260]))
    last = gguf.GGUFReader(written, "r").tensors[-1].data_offset                          # Q8_0: 136 bytes
    assert error(good[:last + 1]) == f"tensor 'q8' ends at byte {last + 136}, past the file's {last + 1}"
