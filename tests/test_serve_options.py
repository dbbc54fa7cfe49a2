"""`pcd serve` and `pcd-mcp` take the same server flags, from one declaration (``ServeOptions``)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mcp_server.__main__ import build_parser as build_mcp_parser
from mcp_server.__main__ import parse_args as parse_mcp_args
from pcd_core.errors import OptionError
from pcd_integrations.commands.main import build_parser as build_pcd_parser
from pcd_integrations.commands.serve_options import ServeOptions


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_pcd_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_both_servers_offer_every_server_option():
    wanted = {spec.metadata["flag"] or f"--{spec.name.replace('_', '-')}" for spec in dataclasses.fields(ServeOptions)}
    assert len(wanted) == len(dataclasses.fields(ServeOptions)) == 9
    assert wanted <= _flags(_serve_parser())
    assert wanted <= _flags(build_mcp_parser())


def test_pcd_serve_flags_build_the_options_the_server_uses():
    args = _serve_parser().parse_args(
        ["--port", "9001", "--max-queue", "3", "--timeout", "2.5", "--header-timeout", "4", "--max-body-bytes", "99"]
    )
    options = ServeOptions.from_args(args)
    assert (options.port, options.max_queue, options.timeout_s, options.otel) == (9001, 3, 2.5, False)
    assert (options.read_timeouts.header_s, options.read_timeouts.body_s) == (4.0, 30.0)
    assert (options.backpressure.max_queue, options.backpressure.timeout_s) == (3, 2.5)
    assert options.limits.max_body_bytes == 99


def test_pcd_mcp_defaults_each_server_flag_to_its_variable(monkeypatch):
    monkeypatch.setenv("PCD_MCP_MAX_QUEUE", "5")
    monkeypatch.setenv("PCD_MCP_BODY_TIMEOUT", "7.5")
    monkeypatch.setenv("PCD_MCP_OTEL", "yes")
    monkeypatch.setenv("PCD_MCP_PORT", "9100")
    options = parse_mcp_args(["--transport", "streamable-http"]).serve_options
    assert (options.max_queue, options.body_timeout_s, options.otel, options.port) == (5, 7.5, True, 9100)
    for variable in ("PCD_MCP_MAX_QUEUE", "PCD_MCP_OTEL"):  # HTTP-only: stdio refuses them
        monkeypatch.delenv(variable)
    assert parse_mcp_args([]).serve_options.port == 9100  # the variable, not pcd serve's 8000
    monkeypatch.delenv("PCD_MCP_PORT")
    assert parse_mcp_args([]).serve_options.port == 8765


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"port": 0}, "not a TCP port"),
        ({"port": 70000}, "not a TCP port"),
        ({"max_queue": -1}, "max_queue"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
    ],
)
def test_a_bad_value_is_an_option_error(changes, says):
    with pytest.raises(OptionError, match=says):
        ServeOptions(**changes)


def test_the_key_is_read_from_the_variable_it_names(monkeypatch):
    assert ServeOptions().api_key() is None
    options = ServeOptions(api_key_env="PCD_TEST_SERVE_KEY")
    monkeypatch.delenv("PCD_TEST_SERVE_KEY", raising=False)
    with pytest.raises(OptionError, match="PCD_TEST_SERVE_KEY"):
        options.api_key()
    monkeypatch.setenv("PCD_TEST_SERVE_KEY", "s3cret")
    assert options.api_key() == "s3cret"
