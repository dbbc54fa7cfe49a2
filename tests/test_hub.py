"""Hub ids on first use, against a loopback server that answers as the Hugging Face Hub does.

The server (``FakeHub``) serves two repositories built from the embedded model: one holding its
torch folder (config, tokenizer, safetensors, plus files a load must not fetch: a ``.bin`` copy and an
``onnx/`` subfolder) and one holding its GGUF beside another GGUF. It answers the calls
``huggingface_hub`` makes, and nothing else: the revision (``/api/models/<repo>/revision/<rev>``), the
file tree (``/api/models/<repo>/tree/<commit>``), and ``HEAD``/``GET`` of ``/<repo>/resolve/<rev>/<file>``
with ``X-Repo-Commit``, an ``ETag`` (the file's sha256) and ``Range``. ``HF_ENDPOINT`` points at it and
``HF_HUB_CACHE`` at a fresh folder, so a test that passes has downloaded: with the download path gone,
the first load finds nothing. No test touches the network: every connection goes to 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from pcd_core import Engine, ModelNotFoundError, OfflineError, PcdError
from pcd_core.loading.hub import fetch_gguf, fetch_model
from pcd_core.loading.model_files import EMBEDDED, converted_dir, resolve

COMMIT = "a1b2c3d4" * 5
REPO = "pcd-tests/smollm2-135m"
GGUF_REPO = "pcd-tests/smollm2-135m-gguf"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {
    "type": "object",
    "properties": {"wants_refund": {"type": "boolean"}, "topic": {"enum": ["billing", "shipping", "other"]}},
}
TEXT = "I was charged twice for my order. Please give me my money back."


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class FakeHub:
    """Repositories of (path in repo -> file on disk), and a log of every request as (method, path, range)."""

    repos: dict[str, dict[str, Path]]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut_after_bytes: int | None = None  # the next GET of a large file stops after this many bytes
    go_away_after_cut: bool = False  # and from then on every GET of a file answers 503
    refuse_gets: bool = False
    honour_range: bool = True
    etags: dict[Path, str] = field(default_factory=dict)

    def etag(self, path: Path) -> str:
        if path not in self.etags:
            self.etags[path] = sha256(path)
        return self.etags[path]

    def tree(self, repo: str) -> list[dict]:
        files = self.repos[repo]
        return [
            {
                "type": "file",
                "path": name,
                "size": path.stat().st_size,
                "oid": hashlib.sha1(name.encode()).hexdigest(),
                "lfs": {"oid": self.etag(path), "size": path.stat().st_size, "pointerSize": 134},
            }
            for name, path in sorted(files.items())
        ]


def handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: the test reads hub.requests
            pass

        def _json(self, body: object, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((method, path, self.headers.get("Range")))
            for repo in hub.repos:
                if path in (f"/api/models/{repo}", f"/api/models/{repo}/revision/main"):
                    return self._json({"id": repo, "sha": COMMIT})
                if path.startswith(f"/api/models/{repo}/revision/"):
                    return self._json({"error": "Invalid rev id"}, 404)
                if path == f"/api/models/{repo}/tree/{COMMIT}":
                    return self._json(hub.tree(repo))
                match = re.fullmatch(rf"/{re.escape(repo)}/resolve/([^/]+)/(.+)", path)
                if match:
                    return self._file(method, repo, match.group(1), match.group(2))
            self._json({"error": "Repository not found"}, 404)
            return None

        def _file(self, method: str, repo: str, revision: str, name: str) -> None:
            source = hub.repos[repo].get(name)
            if source is None or revision not in (COMMIT, "main"):
                self.send_response(404)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            size = source.stat().st_size
            if method == "GET" and hub.refuse_gets:
                return self._json({"error": "unavailable"}, 503)
            start = 0
            wanted = self.headers.get("Range")
            if wanted and hub.honour_range and method == "GET":
                start = int(re.fullmatch(r"bytes=(\d+)-", wanted).group(1))  # type: ignore[union-attr]
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hub.etag(source)}"')
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if method == "HEAD":
                return
            limit, hub.cut_after_bytes = (hub.cut_after_bytes, None) if size > 1 << 20 else (None, hub.cut_after_bytes)
            sent = 0
            with open(source, "rb") as file:
                file.seek(start)
                while chunk := file.read(1 << 20):
                    if limit is not None and sent + len(chunk) > limit:
                        self.wfile.write(chunk[: limit - sent])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)  # the connection drops halfway through the body
                        hub.refuse_gets = hub.go_away_after_cut
                        return
                    self.wfile.write(chunk)
                    sent += len(chunk)

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_GET(self) -> None:
            self._route("GET")

    return Handler


@pytest.fixture(scope="module")
def fake_hub(engine, tmp_path_factory) -> Iterator[tuple[FakeHub, str]]:
    """The fake hub and its address; the ``engine`` fixture has written the torch folder it serves."""
    folder = converted_dir(EMBEDDED["smollm2-135m"].locate())
    assert (folder / "model.safetensors").is_file(), "the engine fixture converts the embedded model"
    decoys = tmp_path_factory.mktemp("decoys")
    (decoys / "pytorch_model.bin").write_bytes(b"not to be fetched" * 100)
    (decoys / "model.onnx").write_bytes(b"not to be fetched either")
    (decoys / "other.gguf").write_bytes(b"GGUF" + b"\0" * 2000)
    files = {p.name: p for p in folder.iterdir() if p.is_file()}
    files |= {"pytorch_model.bin": decoys / "pytorch_model.bin", "onnx/model.onnx": decoys / "model.onnx"}
    gguf = EMBEDDED["smollm2-135m"].locate()
    hub = FakeHub({REPO: files, GGUF_REPO: {GGUF_FILE: gguf, "SmolLM2-other.Q8_0.gguf": decoys / "other.gguf"}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield hub, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def hub_env(fake_hub, tmp_path, monkeypatch) -> tuple[FakeHub, Path]:
    """Downloads allowed, from the fake hub, into an empty cache; the server's state reset."""
    from huggingface_hub import constants

    hub, address = fake_hub
    hub.requests.clear()
    hub.cut_after_bytes, hub.go_away_after_cut, hub.refuse_gets, hub.honour_range = None, False, False, True
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_ENDPOINT", address)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest set it before the import
    return hub, cache


def fetched(hub: FakeHub) -> set[str]:
    return {
        path.split("/resolve/", 1)[1].split("/", 1)[1]
        for method, path, _ in hub.requests
        if method == "GET" and "/resolve/" in path
    }


@pytest.mark.slow
def test_a_hub_id_downloads_once_into_the_hf_cache_and_loads(hub_env, engine, capfd, monkeypatch):
    hub, cache = hub_env
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub's bars as on a terminal (stderr is a pipe here)
    capfd.readouterr()
    downloaded = Engine.load(REPO)
    progress = capfd.readouterr().err
    assert "Fetching 6 files: 100%" in progress  # the files...
    assert re.search(r"Downloading bytes.*\b5\d\d[MB]", progress), progress[-500:]  # ...and the bytes, on stderr
    assert fetched(hub) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors",
    }  # no .bin, no subfolder
    repo = cache / "models--pcd-tests--smollm2-135m"
    assert (repo / "refs" / "main").read_text() == COMMIT
    weights = repo / "snapshots" / COMMIT / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == repo / "blobs" / sha256(weights)
    assert not list(repo.rglob("*.incomplete"))
    expected = engine.fill(SCHEMA, TEXT)
    got = downloaded.fill(SCHEMA, TEXT)
    assert got.value == expected.value
    for name, result in got.fields.items():
        assert result.probability == pytest.approx(expected.fields[name].probability, abs=1e-6)

    hub.requests.clear()
    assert resolve(REPO).pretrained == str(repo / "snapshots" / COMMIT)
    assert resolve(REPO, revision=COMMIT).pretrained == str(repo / "snapshots" / COMMIT)
    assert resolve(REPO, offline=True).pretrained == str(repo / "snapshots" / COMMIT)
    assert hub.requests == []  # the second load asks the hub nothing


def test_offline_refuses_and_says_what_is_missing(hub_env, monkeypatch):
    hub, cache = hub_env
    with pytest.raises(
        OfflineError, match=r"'pcd-tests/smollm2-135m' is not in the local Hugging Face cache"
    ) as caught:
        resolve(REPO, offline=True)
    assert str(cache) in str(caught.value) and "no snapshot" in str(caught.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="hf download pcd-tests/smollm2-135m-gguf SmolLM2"):
        resolve(f"{GGUF_REPO}:{GGUF_FILE}")
    assert hub.requests == []
    # a snapshot that lacks its weights is named as such
    snapshot = cache / "models--pcd-tests--smollm2-135m" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    with pytest.raises(OfflineError, match=r"lacks a tokenizer .*, the weights \(\*\.safetensors\)"):
        fetch_model(REPO)


def test_a_revision_pins_what_is_read_and_an_unknown_one_is_not_found(hub_env):
    hub, cache = hub_env
    with pytest.raises(
        ModelNotFoundError, match="no 'pcd-tests/smollm2-135m-gguf:SmolLM2-135M-Instruct.Q4_1.gguf' at revision 'v9'"
    ):
        fetch_gguf(GGUF_REPO, GGUF_FILE, revision="v9")
    with pytest.raises(ModelNotFoundError, match="the hub has no 'pcd-tests/nothing-here'"):
        fetch_model("pcd-tests/nothing-here")


@pytest.mark.parametrize(
    ("honour_range", "goes_away"), [(True, False), (False, False), (True, True)], ids=["resumes", "restarts", "fails"]
)
def test_an_interrupted_download_completes_or_leaves_nothing_behind(hub_env, honour_range, goes_away):
    """The connection drops after 25 MiB of the GGUF. huggingface_hub asks for the rest (``Range``) from
    the last whole chunk it wrote (``DOWNLOAD_CHUNK_SIZE``, 10 MiB); a hub
    that ignores it sends the whole file again, and the start is not written twice; a hub that has gone
    away fails the load, leaving no file that a later load would trust, and the next load starts over.
    """
    hub, cache = hub_env
    hub.honour_range, hub.go_away_after_cut = honour_range, goes_away
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

    hub.cut_after_bytes = 25 << 20
    kept = hub.cut_after_bytes // DOWNLOAD_CHUNK_SIZE * DOWNLOAD_CHUNK_SIZE
    repo = cache / "models--pcd-tests--smollm2-135m-gguf"
    if goes_away:
        with pytest.raises(PcdError, match="loading again resumes it"):
            fetch_gguf(GGUF_REPO, GGUF_FILE)
        assert not (repo / "snapshots" / COMMIT / GGUF_FILE).exists()
        assert not list(repo.glob("blobs/*"))  # neither a blob nor a part file
        hub.refuse_gets = False
        hub.requests.clear()
    path = fetch_gguf(GGUF_REPO, GGUF_FILE)
    gets = [wanted for method, p, wanted in hub.requests if method == "GET" and p.endswith(GGUF_FILE)]
    assert gets == ([None] if goes_away else [None, f"bytes={kept}-"])
    assert path == repo / "snapshots" / COMMIT / GGUF_FILE
    assert sha256(path) == sha256(EMBEDDED["smollm2-135m"].locate())
    assert not list(repo.rglob("*.incomplete"))
    assert fetched(hub) == {GGUF_FILE}  # the other GGUF in the repository is never fetched


def test_offline_and_revision_are_flags_of_every_command():
    from pcd_integrations.commands.common import options_from_args
    from pcd_integrations.commands.main import build_parser

    argv = ["fill", "--schema", "s.json", "--input", "t.txt", "--model", REPO, "--offline", "--revision", COMMIT]
    options = options_from_args(build_parser().parse_args(argv))
    assert (options.model, options.offline, options.revision) == (REPO, True, COMMIT)
    assert options_from_args(build_parser().parse_args(argv[:5])).offline is False


def test_embedded_aliases_and_their_typos_never_reach_the_hub(hub_env):
    hub, cache = hub_env  # downloads allowed, the hub one connection away
    assert resolve("smollm2-135m").gguf == EMBEDDED["smollm2-135m"].locate()
    with pytest.raises(PcdError, match="did you mean 'smollm2-135m'"):
        resolve("smollm2-135")
    assert hub.requests == [] and not cache.exists()
