"""What a user installs: a wheel built from this tree ships the type marker, the bundled cases, the
licence and both console scripts; ``server.json`` (the MCP registry manifest) agrees with pyproject."""

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import pcd_core
from mcp_server.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
MANIFEST = json.loads((ROOT / "server.json").read_text())
PACKAGES = ("pcd_core", "pcd_integrations", "mcp_server")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """Built from a copy, so that the build's own folders never land in the working tree."""
    source = tmp_path_factory.mktemp("source") / "pcd-engine"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__", "out")
    )
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w"]
    subprocess.run([*command, str(out)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("pcd_engine-*.whl")
    return zipfile.ZipFile(built)


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    return wheel.read(f"pcd_engine-{PROJECT['version']}.dist-info/{name}").decode()


def test_the_wheel_ships_the_type_markers_and_the_bundled_cases(wheel):
    names = set(wheel.namelist())
    assert {f"{package}/py.typed" for package in PACKAGES} <= names
    cases = {f"pcd_core/benchdata/{p.name}" for p in (ROOT / "pcd_core" / "benchdata").glob("*.json")}
    assert cases and cases <= names
    shapes = {f"pcd_core/loading/archs/{p.name}" for p in (ROOT / "pcd_core" / "loading" / "archs").glob("*.json")}
    assert shapes and shapes <= names  # pcd bench --dummy-weights
    page = {
        f"pcd_integrations/http/playground/{p.name}"
        for p in (ROOT / "pcd_integrations" / "http" / "playground").iterdir()
    }
    assert page - {"pcd_integrations/http/playground/__pycache__"} <= names  # pcd serve's GET / and its examples
    sources = {p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert sources <= names


def test_the_wheel_carries_the_licence_and_the_metadata(wheel):
    metadata = dist_info(wheel, "METADATA")
    assert "License-Expression: MIT" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Project-URL: Repository," in metadata
    assert "Permission is hereby granted" in dist_info(wheel, "licenses/LICENSE")
    scripts = dist_info(wheel, "entry_points.txt")
    for script, target in PROJECT["scripts"].items():
        assert f"{script} = {target}" in scripts


def test_the_licence_file_is_the_declared_licence():
    assert PROJECT["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_the_version_is_one_number_everywhere():
    assert pcd_core.__version__ == PROJECT["version"]
    assert MANIFEST["version"] == PROJECT["version"]
    assert [p["version"] for p in MANIFEST["packages"]] == [PROJECT["version"]]


def test_server_json_names_this_package_and_its_console_script():
    assert re.fullmatch(
        r"https://static\.modelcontextprotocol\.io/schemas/\d{4}-\d{2}-\d{2}/server\.schema\.json", MANIFEST["$schema"]
    )
    assert re.fullmatch(r"[a-zA-Z0-9.-]+/[a-zA-Z0-9._-]+", MANIFEST["name"])
    assert 1 <= len(MANIFEST["description"]) <= 100
    (package,) = MANIFEST["packages"]
    assert (package["registryType"], package["identifier"]) == ("pypi", PROJECT["name"])
    assert package["transport"] == {"type": "stdio"}
    published = MANIFEST["_meta"]["io.modelcontextprotocol.registry/publisher-provided"]
    assert PROJECT["scripts"][published["command"]] == "mcp_server.__main__:main"
    assert set(published["extras"]) <= set(PROJECT["optional-dependencies"])


def test_server_json_lists_only_variables_that_pcd_mcp_reads():
    documented = build_parser().format_help()
    for variable in MANIFEST["packages"][0]["environmentVariables"]:
        assert f"({variable['name']}" in documented, variable["name"]
