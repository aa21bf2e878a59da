"""Unpacking uploaded run archives: traces come out, nothing else gets in."""

import io
import tarfile

import pytest

from ddpscope.viz.sources import archive
from ddpscope.viz.sources.archive import extract_run_archive, safe_name
from ddpscope.viz.trace import TraceError, load_run
from tests.conftest import SAMPLES


def _tar(add) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        add(t)
    return buf.getvalue()


def _add_bytes(t, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    t.addfile(info, io.BytesIO(data))


def test_tar_gz_of_a_run_folder_loads(tmp_path):
    src = SAMPLES / "mlp-2rank-cap1mb"
    data = _tar(lambda t: [t.add(p, arcname=f"run/{p.name}") for p in src.iterdir()])
    out = extract_run_archive(data, "run.tar.gz", tmp_path / "x")
    assert sorted(p.name for p in out.iterdir()) == ["rank-0.json", "rank-1.json", "run.json"]
    assert load_run(out).world_size == 2


def test_links_and_oversized_archives_are_refused(tmp_path, monkeypatch):
    def with_link(t):
        info = tarfile.TarInfo("rank-0.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(info)
    with pytest.raises(TraceError, match="link or device"):
        extract_run_archive(_tar(with_link), "l.tgz", tmp_path / "a")
    monkeypatch.setattr(archive, "MAX_UNPACKED_BYTES", 1000)
    with pytest.raises(TraceError, match="unpacks to more than"):
        extract_run_archive(_tar(lambda t: _add_bytes(t, "rank-0.json", b" " * 5000)), "big.tgz", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_safe_names():
    assert safe_name("../../etc/passwd") == "etc-passwd"
    assert safe_name("my run (2)") == "my-run-2"
    assert safe_name("...") == "upload"


@pytest.mark.parametrize("top", ["", "run/"])
def test_a_profiled_run_keeps_its_profile_folder(tmp_path, top):
    import gzip
    import json

    from ddpscope.viz.sources import folder_kind
    from ddpscope.viz.sources.run_profile import profile_folder
    from tests.viz.sources.test_kineto import gpu_profile

    src = SAMPLES / "mlp-2rank-cap1mb"
    prof = gzip.compress(json.dumps(gpu_profile(0)).encode())

    def add(t):
        for p in src.iterdir():
            t.add(p, arcname=f"{top}{p.name}")
        _add_bytes(t, f"{top}profile/rank-0.pt.trace.json.gz", prof)

    out = extract_run_archive(_tar(add), "run.tar.gz", tmp_path / "x")
    assert folder_kind(out) == "ddp" and folder_kind(out / "profile") == "kineto"
    assert profile_folder(load_run(out)) == out / "profile"


def _zip_bytes(files: dict[str, bytes]) -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_bytes_really_inflated_count_not_the_headers_claim(tmp_path, monkeypatch):
    import struct

    monkeypatch.setattr(archive, "MAX_UNPACKED_BYTES", 2**20)
    data = bytearray(_zip_bytes({"rank-0.json": b" " * (8 * 2**20)}))  # 8 MiB of spaces: a few KiB zipped
    # understate the size in both headers (local: offset 22, central directory: +24 from its signature)
    struct.pack_into("<I", data, 22, 100)
    cd = data.find(b"PK\x01\x02")
    struct.pack_into("<I", data, cd + 24, 100)
    with pytest.raises(TraceError) as e:  # zipfile stops at the claimed size, then the CRC fails
        extract_run_archive(bytes(data), "liar.zip", tmp_path / "x")
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
    honest = _zip_bytes({"rank-0.json": b" " * (8 * 2**20)})
    with pytest.raises(TraceError, match="unpacks to more than 1 MiB"):  # counted as it inflates
        extract_run_archive(honest, "big.zip", tmp_path / "y")
    bomb = _tar(lambda t: _add_bytes(t, "rank-0.json", b" " * (8 * 2**20)))
    with pytest.raises(TraceError, match="unpacks to more than 1 MiB"):
        extract_run_archive(bomb, "big.tar.gz", tmp_path / "z")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, make, message", [
    ("encrypted.zip", lambda: _encrypted(_zip_bytes({"rank-0.json": b"{}"})), "cannot be unpacked"),
    ("cut.zip", lambda: _zip_bytes({"rank-0.json": b"x" * 5000, "run.json": b"{}"})[:-40], "not a readable"),
    ("cut.tar.gz", lambda: _tar(lambda t: _add_bytes(t, "rank-0.json", b"y" * 100_000))[:-300], "not a readable"),
    ("flipped.zip", lambda: _flip(_zip_bytes({"rank-0.json": b"z" * 5000})), "not a readable"),
])
def test_broken_archives_are_one_line_and_leave_nothing(tmp_path, name, make, message):
    with pytest.raises(TraceError) as e:
        extract_run_archive(make(), name, tmp_path / "x")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())


def _encrypted(data: bytes) -> bytes:
    """The same zip with its members flagged encrypted (zipfile then asks for a password)."""
    data = bytearray(data)
    for sig, off in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(sig)
        data[at + off] |= 1
    return bytes(data)


def _flip(data: bytes) -> bytes:
    data = bytearray(data)
    at = data.find(b"PK\x03\x04") + 40  # inside the compressed data
    for i in range(at, at + 20):
        data[i] ^= 0xFF
    return bytes(data)
