"""`kestrelc build ORG/NAME`: a Hugging Face repository id is found in the local Hugging Face cache (the layout
`hf download` leaves: models--ORG--NAME/refs/main naming a snapshot of symbolic links into blobs/); nothing is
downloaded, and a repository not in the cache is refused in one line saying how to get it."""
import json
import os
import shutil

import pytest

from conftest import run_cli
from kestrel.artifacts.errors import ConfigError
from kestrel.compiler.presets import synthesize

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hugging Face cache holding tiny as Kestrel/Tiny (files as blobs, the snapshot of links to them)."""
    cache = tmp_path_factory.mktemp("hub")
    src = synthesize("tiny", str(tmp_path_factory.mktemp("tiny")))
    repo = cache / "models--Kestrel--Tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, name in enumerate(sorted(os.listdir(src))):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(os.path.join(src, name), blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")


@pytest.mark.parametrize("model", ["Kestrel/Tiny", f"Kestrel/Tiny@{COMMIT}"])
def test_build_from_the_hub_cache(model, hub, tmp_path):
    out = tmp_path / "m.plan"
    r = run_cli("kestrelc", "build", model, "-o", str(out), env=hub)
    assert r.returncode == 0, r.stderr
    info = json.loads(run_cli("kestrelc", "inspect", str(out), "--json", env=hub).stdout)
    assert info["source"]["repo"] == "Kestrel/Tiny" and info["source"]["revision"] == COMMIT
    assert info["source"]["path"].endswith(os.path.join("snapshots", COMMIT))
    text = run_cli("kestrelc", "inspect", str(out), env=hub).stdout
    assert f"source    Kestrel/Tiny@{COMMIT} (checkpoint: " in text


@pytest.mark.parametrize("model, hint", [("Kestrel/Missing", "hf download Kestrel/Missing)"),
                                         ("Kestrel/Tiny@v9", "hf download Kestrel/Tiny --revision v9)")])
def test_a_repository_not_in_the_cache_is_refused_in_one_line(model, hint, hub, tmp_path):
    r = run_cli("kestrelc", "build", model, "-o", str(tmp_path / "m.plan"), env=hub)
    assert r.returncode == ConfigError.exit_code and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "not in the Hugging Face cache" in errors[0] and hint in errors[0], r.stderr
    assert not (tmp_path / "m.plan").exists()


def test_nothing_is_downloaded(monkeypatch):
    """The lookup asks the cache only (local_files_only), whatever the network and HF_HUB_OFFLINE say."""
    from kestrel.compiler import frontend
    from kestrel.compiler.frontend import find_checkpoint

    asked = []

    def snapshot_download(repo, **kw):
        asked.append((repo, kw))
        return "/cache/models--Kestrel--Tiny/snapshots/" + COMMIT
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(frontend, "snapshot_download", snapshot_download)
    assert find_checkpoint("Kestrel/Tiny@v2") == ("/cache/models--Kestrel--Tiny/snapshots/" + COMMIT,
                                                  {"repo": "Kestrel/Tiny", "revision": COMMIT})
    assert asked == [("Kestrel/Tiny", {"revision": "v2", "local_files_only": True})]


@pytest.mark.parametrize("model", ["my/model--v2", "a/b@../..", "x/" + "y" * 100])
def test_names_no_repository_can_have_are_not_looked_up(model, hub, tmp_path):
    """A path that does not exist but looks like ORG/NAME, with what no repository id may hold ("--", "..", over
    96 characters): one line, exit 3, no traceback."""
    r = run_cli("kestrelc", "build", model, "-o", str(tmp_path / "m.plan"), env=hub)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == ConfigError.exit_code and len(lines) == 1, r.stderr
    assert "no such checkpoint folder (or preset name)" in lines[0] and "Traceback" not in r.stderr
