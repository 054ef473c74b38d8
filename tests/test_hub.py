"""Tests of gpt2_core.loading.hub against a fake Hugging Face Hub on 127.0.0.1: no internet is needed, or touched.

    python -m pytest tests/test_hub.py -q

`FakeHub` answers the two requests hf_hub_download makes: HEAD /{repo_id}/resolve/{revision}/{filename} for the
file's metadata (X-Repo-Commit, ETag, size), then GET for the bytes. Like the real Hub, weights are LFS files:
their HEAD answers with a redirect to a second server (the "CDN") plus X-Linked-Etag / X-Linked-Size.
huggingface_hub reads HF_ENDPOINT / HF_HOME when it is imported, so most tests point its `constants` at the fake
hub and a temporary cache; one test runs a fresh Python with only the environment variables set.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest

hf = pytest.importorskip("huggingface_hub")  # the optional [hub] extra
from huggingface_hub import constants as hf_constants  # noqa: E402

from gpt2_core.loading import hub  # noqa: E402
from gpt2_core.errors import CheckpointError  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# Nothing may connect anywhere but loopback.

CONNECTIONS: list = []


def _check_loopback(address):
    if isinstance(address, tuple):  # AF_INET / AF_INET6; AF_UNIX addresses are paths
        host = str(address[0]).split("%")[0]
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            raise AssertionError(f"test tried to connect to non-loopback address {address!r}")
        CONNECTIONS.append(address)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex
    monkeypatch.setattr(socket.socket, "connect", lambda s, a: (_check_loopback(a), connect(s, a))[1])
    monkeypatch.setattr(socket.socket, "connect_ex", lambda s, a: (_check_loopback(a), connect_ex(s, a))[1])


# ---------------------------------------------------------------------------------------------------------------
# The fake hub


def tiny_safetensors() -> bytes:  # written by hand: 8-byte header length, JSON header, raw data
    header = json.dumps({"wte.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + np.arange(8, dtype=np.float32).tobytes()


CONFIG = json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 4, "n_positions": 8,
                     "vocab_size": 2}).encode()
TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}})
NEW_REPO = {"config.json": CONFIG, "model.safetensors": tiny_safetensors(), "tokenizer.json": TOKENIZER_JSON.encode()}
OLD_REPO = {"config.json": CONFIG, "pytorch_model.bin": (ROOT / "tests/fixtures/tiny_zip.bin").read_bytes(),
            "vocab.json": b'{"a": 0, "b": 1}', "merges.txt": b"#version: 0.2\n"}
LFS = (".safetensors", ".bin")


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos, self.requests = repos, []
        self.blobs = {hashlib.sha256(d).hexdigest(): d for files in repos.values() for d in files.values()}
        self.hub, self.cdn = self._server(self._hub), self._server(self._cdn)
        self.url = f"http://127.0.0.1:{self.hub.server_port}"

    def _server(self, serve):
        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: one request per connection, nothing kept alive
            def do_HEAD(self):
                serve(self, body=False)

            def do_GET(self):
                serve(self, body=True)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return server

    def stop(self):
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    @staticmethod
    def _reply(req, status, headers, body=b""):
        req.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            req.send_header(k, v)
        req.end_headers()
        if req.command == "GET":
            req.wfile.write(body)

    def _hub(self, req, body):
        self.requests.append(f"{req.command} {req.path}")
        repo_id, found, rest = unquote(urlsplit(req.path).path).lstrip("/").partition("/resolve/")
        revision, _, filename = rest.partition("/")
        if not found or repo_id not in self.repos:
            return self._reply(req, 404, {"X-Error-Code": "RepoNotFound"})  # (the Hub says 401 to strangers)
        if revision not in ("main", COMMIT):
            return self._reply(req, 404, {"X-Error-Code": "RevisionNotFound"})
        files = self.repos[repo_id]
        if filename not in files:
            return self._reply(req, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
        data = files[filename]
        sha = hashlib.sha256(data).hexdigest()
        if filename.endswith(LFS):  # LFS file: metadata in X-Linked-*, the bytes on the CDN
            pointer_etag = hashlib.sha1(sha.encode()).hexdigest()  # the git id of the small LFS pointer file
            return self._reply(req, 302, {"X-Repo-Commit": COMMIT, "ETag": f'"{pointer_etag}"',
                                          "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                                          "Location": f"http://127.0.0.1:{self.cdn.server_port}/blobs/{sha}"})
        self._reply(req, 200, {"X-Repo-Commit": COMMIT, "ETag": f'"{sha[:40]}"'}, data)

    def _cdn(self, req, body):
        self.requests.append(f"CDN {req.command} {req.path}")
        data = self.blobs.get(req.path.rsplit("/", 1)[-1])
        self._reply(req, 200, {}, data) if data is not None else self._reply(req, 404, {})


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """Point huggingface_hub at a fake hub (started by the test with `serve`) and an empty cache in tmp_path."""
    servers = []

    def serve(repos):
        fake = FakeHub(repos)
        servers.append(fake)
        c = hf_constants
        monkeypatch.setattr(c, "ENDPOINT", fake.url)
        template = fake.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        from huggingface_hub import file_download  # 0.x copies the template when this module is first imported
        monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template, raising=False)
        return fake

    c = hf_constants
    paths = {"HF_HOME": "hf", "HF_HUB_CACHE": "hf/hub", "HF_TOKEN_PATH": "hf/token", "HF_STORED_TOKENS_PATH": "hf/tokens"}
    for name, value in paths.items():
        monkeypatch.setattr(c, name, str(tmp_path / value))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "HF_HUB_DISABLE_TELEMETRY", True)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    serve.cache = tmp_path / "hf/hub"
    yield serve
    for fake in servers:
        fake.stop()


@pytest.fixture(params=["installed", "0.x names"])
def hub_names(request, monkeypatch):
    """huggingface_hub as installed, and as 0.x names things: no ``errors.RemoteEntryNotFoundError`` (a file missing
    from the repo is an ``EntryNotFoundError``, of which ``LocalEntryNotFoundError`` is a subclass, as in 1.x and 2.x
    too) and no ``is_offline_mode()`` (only ``constants.HF_HUB_OFFLINE``). The classes raised are the installed ones,
    so the second run checks that hub.py needs neither name. CI also runs this file with 0.30, the declared floor."""
    if request.param == "0.x names":
        monkeypatch.delattr(hf.errors, "RemoteEntryNotFoundError", raising=False)
        monkeypatch.setattr(hf, "is_offline_mode", None, raising=False)  # a lazy attribute: cannot be deleted
        assert issubclass(hf.errors.LocalEntryNotFoundError, hf.errors.EntryNotFoundError)
    return request.param


# ---------------------------------------------------------------------------------------------------------------
# Tests


def test_download_then_offline_from_cache(hub_env, hub_names):
    fake = hub_env({"openai-community/gpt2": NEW_REPO})
    CONNECTIONS.clear()
    folder = hub.download("gpt2")  # the alias resolves to openai-community/gpt2
    assert folder == hub_env.cache / "models--openai-community--gpt2" / "snapshots" / COMMIT
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    for name, data in NEW_REPO.items():
        assert (folder / name).read_bytes() == data
    assert "HEAD /openai-community/gpt2/resolve/main/config.json" in fake.requests
    assert any(r.startswith("CDN GET /blobs/") for r in fake.requests)  # the weights came through the redirect
    assert not any("pytorch_model.bin" in r or "vocab.json" in r for r in fake.requests)  # no needless fallbacks
    assert CONNECTIONS and all(a[0] == "127.0.0.1" for a in CONNECTIONS)  # the loopback guard did see them

    fake.stop()  # offline now: the cache alone must do
    n = len(fake.requests)
    assert hub.download("gpt2") == folder
    assert hub.download("openai-community/gpt2") == folder
    assert len(fake.requests) == n


def test_falls_back_to_pytorch_bin_and_vocab_merges(hub_env, hub_names):
    fake = hub_env({"someone/old-gpt2": OLD_REPO})
    folder = hub.download("someone/old-gpt2")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "merges.txt", "pytorch_model.bin", "vocab.json"]
    assert (folder / "pytorch_model.bin").read_bytes() == OLD_REPO["pytorch_model.bin"]
    assert any("model.safetensors" in r for r in fake.requests)  # asked for first, got 404
    fake.stop()
    assert hub.download("someone/old-gpt2") == folder  # the fallbacks work from the cache too


def test_pinned_revision(hub_env):
    hub_env({"openai-community/gpt2": NEW_REPO})
    assert hub.download("gpt2", revision=COMMIT).name == COMMIT
    with pytest.raises(CheckpointError, match="no revision 'v9'"):
        hub.download("gpt2", revision="v9")


def assert_helpful(msg: str, name: str, repo_id: str):
    assert repr(name) in msg and "could not fetch" in msg
    folder = repo_id.split("/")[-1]
    assert f"hf download {repo_id} config.json model.safetensors tokenizer.json --local-dir {folder}" in msg
    assert f'load_model("path/to/{folder}")' in msg


def test_unknown_repo(hub_env, hub_names):
    hub_env({"openai-community/gpt2": NEW_REPO})
    with pytest.raises(CheckpointError) as info:
        hub.download("nobody/nothing")
    assert "no such repository" in str(info.value)
    assert_helpful(str(info.value), "nobody/nothing", "nobody/nothing")


def test_repo_without_weights(hub_env, hub_names):
    hub_env({"someone/configs-only": {"config.json": CONFIG}})
    with pytest.raises(CheckpointError, match=r"no weights file \(model.safetensors or pytorch_model.bin\)"):
        hub.download("someone/configs-only")


def test_repo_without_config(hub_env, hub_names):
    hub_env({"someone/weights-only": {"model.safetensors": NEW_REPO["model.safetensors"]}})
    with pytest.raises(CheckpointError, match="the repository has no config.json, so it is not a model in Hugging "
                                              "Face layout"):
        hub.download("someone/weights-only")


@pytest.mark.parametrize("names", ["installed", "0.x names"])
def test_hf_hub_offline_is_named(names, tmp_path):
    """HF_HUB_OFFLINE=1 set before huggingface_hub is imported, as a user sets it (a fresh process: huggingface_hub
    reads it at import, and its HTTP sessions keep it)."""
    as_0x = ("import huggingface_hub as hf, huggingface_hub.errors, huggingface_hub.file_download\n"
             "hf.is_offline_mode = None\n"
             "if hasattr(hf.errors, 'RemoteEntryNotFoundError'):\n"
             "    del hf.errors.RemoteEntryNotFoundError\n") if names == "0.x names" else ""
    code = as_0x + ("from gpt2_core.loading import hub\n"
                    "try:\n"
                    "    hub.download('gpt2')\n"
                    "except Exception as e:\n"
                    "    print(type(e).__name__, e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CheckpointError could not fetch the files of 'gpt2'")
    assert "the Hub could not be reached (HF_HUB_OFFLINE is set) and they are not in the local cache" in out.stdout


def test_offline_with_empty_cache_fails_fast(hub_env, hub_names):
    fake = hub_env({"openai-community/gpt2": NEW_REPO})
    fake.stop()
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        hub.download("gpt2")
    assert time.perf_counter() - start < 5  # no 30 s of retries
    msg = str(info.value)
    assert "'gpt2' (openai-community/gpt2)" in msg and "could not be reached" in msg and "local cache" in msg
    assert_helpful(msg, "gpt2", "openai-community/gpt2")


def test_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    with pytest.raises(CheckpointError, match=r"pip install 'gpt2-numpy\[hub\]'"):
        hub.download("gpt2")


def test_is_hub_name(tmp_path, monkeypatch):
    for name in ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2", "openai-community/gpt2", "a-b/c_d.1"]:
        assert hub.is_hub_name(name), name
    for name in ["", "gpt3", "a/b/c", "./gpt2", "/abs/path", "owner/", "with space/x", "model.safetensors"]:
        assert not hub.is_hub_name(name), name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner/repo").mkdir(parents=True)
    (tmp_path / "gpt2").mkdir()
    assert not hub.is_hub_name("owner/repo") and not hub.is_hub_name("gpt2")  # local paths win
    with pytest.raises(CheckpointError, match="neither an existing local path nor a Hub name"):
        hub.download("a/b/c")  # refused before any network or cache look-up


def test_environment_variables_in_a_fresh_process(hub_env, tmp_path):
    """The user's way: HF_ENDPOINT and HF_HOME set before huggingface_hub is imported."""
    fake = hub_env({"openai-community/gpt2": NEW_REPO})
    guard = ("import ipaddress, socket\n"
             "_connect = socket.socket.connect\n"
             "def connect(self, a):\n"
             "    if isinstance(a, tuple) and not ipaddress.ip_address(a[0].split('%')[0]).is_loopback:\n"
             "        raise SystemExit(f'non-loopback connection to {a}')\n"
             "    return _connect(self, a)\n"
             "socket.socket.connect = connect\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=fake.url, HF_HOME=str(tmp_path / "fresh"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run([sys.executable, "-c", guard + "from gpt2_core.loading import hub; print(hub.download('gpt2'))"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder == tmp_path / "fresh/hub/models--openai-community--gpt2/snapshots" / COMMIT
    assert (folder / "model.safetensors").read_bytes() == NEW_REPO["model.safetensors"]


def test_load_model_by_name_end_to_end(hub_env, tmp_path):
    """load_model("owner/repo") downloads through the fake hub and gives the same logits as the local files."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import write_checkpoint

    import gpt2_core
    from gpt2_core import GPT2Config

    tokenizer = ROOT / "gpt2_core" / "data" / "embedded" / "tokenizer.json"
    config = GPT2Config(vocab_size=4096, n_positions=32, n_embd=16, n_head=2, n_layer=1, eos_token_id=4095)
    local = write_checkpoint(tmp_path / "local", gpt2_core.random_model(config, seed=5))
    files = {name: (local / name).read_bytes() for name in ("config.json", "model.safetensors")}
    files["tokenizer.json"] = tokenizer.read_bytes()
    hub_env({"someone/tiny-gpt2": files})
    model = gpt2_core.load_model("someone/tiny-gpt2")
    ids = model.tokenizer.encode("Emma Woodhouse")
    np.testing.assert_array_equal(gpt2_core.forward(model, ids), gpt2_core.forward(gpt2_core.load_model(local), ids))
    assert "models--someone--tiny-gpt2" in model.source
