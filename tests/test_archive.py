"""Unpacking uploaded run archives: traces come out, nothing else gets in."""

import io
import tarfile

import pytest

from tests.conftest import SAMPLES
from viz import archive
from viz.archive import extract_run_archive, safe_name
from viz.trace import TraceError, load_run


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

    from tests.test_kineto import gpu_profile
    from viz.profile_check import profile_folder
    from viz.sources import folder_kind

    src = SAMPLES / "mlp-2rank-cap1mb"
    prof = gzip.compress(json.dumps(gpu_profile(0)).encode())

    def add(t):
        for p in src.iterdir():
            t.add(p, arcname=f"{top}{p.name}")
        _add_bytes(t, f"{top}profile/rank-0.pt.trace.json.gz", prof)

    out = extract_run_archive(_tar(add), "run.tar.gz", tmp_path / "x")
    assert folder_kind(out) == "ddp" and folder_kind(out / "profile") == "kineto"
    assert profile_folder(load_run(out)) == out / "profile"
