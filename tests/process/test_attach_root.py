"""``nxl attach PID`` as root against another user's process, and what any attach owes the process it enters.

Root runs, imports and believes nothing the target's user controls: a version faked by a ``sitecustomize`` on
the user's PYTHONPATH and an interpreter link the user repoints after the checks make root run nothing of the
user's (a marker the user's script would write as root stays absent) and the attach goes through gdb on the real
interpreter. ``--sink`` never hands root's files over: an existing folder is refused, a new one is the only thing
given to the user, and what a failed attach made is taken back, once handed over only as far as the user could
remove it (never by a path they can redirect). Text from the target (the model's name) reaches root's terminal
escaped. A concurrent tracer (another ``nxl attach``'s gdb) is waited for, then named; and the
target's stderr holds nothing but nxl's own lines after an attach and a detach.

The other user is a real one, created here (``useradd``) and removed at the end; its process runs the system's
Python of this interpreter's version, with this checkout and this environment's packages on its PYTHONPATH.
Every process is stopped by PID; nothing is written outside the test's own temporary folder.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import nxl_hooks
from nxl_hooks.apps.serve.inject import trusted_file
from serving import gdb_refusal, save_chat_model
from test_serve import _cli

REPO = Path(nxl_hooks.__file__).resolve().parent.parent
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}")
#: the model's folder, so its name (what nxl attach prints) holds escape sequences: colour, window title, bell
MODEL_NAME = "tiny\x1b[31mRED\x1b]0;owned\x07"

pytestmark = pytest.mark.skipif(gdb_refusal() is not None,
                                reason=f"nxl attach PID injects through gdb: {gdb_refusal()}")

_TARGET = textwrap.dedent("""
    import json, sys, time
    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(sys.argv[1]).eval()
    ids = AutoTokenizer.from_pretrained(sys.argv[1])("hello world how are you", return_tensors="pt")["input_ids"]
    print("ready", flush=True)
    started = time.monotonic()
    while time.monotonic() - started < 900:
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        print(json.dumps(out[0, ids.shape[1]:].tolist()), flush=True)
        time.sleep(0.05)
""")

_POPEN = subprocess.Popen  #: the real one, while a test hooks it
#: On the user's PYTHONPATH: an interpreter asked its version or where it finds nxl_hooks (nxl attach's check, as it
#: was) claims to be 3.14.
_FAKE_VERSION = ("import sys\nif any(word in ' '.join(sys.orig_argv) for word in ('find_spec', 'version_info')):\n"
                 "    sys.version_info = (3, 14, 0, 'final', 0)\n")


class Process:
    """A target started with ``argv`` (as ``user``, or as this process's user), its stdout and stderr in files."""

    def __init__(self, folder: Path, argv: list[str], env: dict, user: str | None = None) -> None:
        self.out, self.err = folder / "out.log", folder / "err.log"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=folder, user=user,
                                            group=user, extra_groups=[] if user else None, start_new_session=True)
        self.pid = self.process.pid
        deadline = time.monotonic() + 240
        while "ready" not in self.out.read_text():
            assert self.process.poll() is None and time.monotonic() < deadline, self.err.read_text()[-3000:]
            time.sleep(0.1)

    def steps(self) -> int:
        return len(self.out.read_text().splitlines())

    def runs_on(self, more: int = 3) -> None:
        """It goes on generating: ``more`` loops after now."""
        seen, deadline = self.steps(), time.monotonic() + 120
        while self.steps() < seen + more:
            assert self.process.poll() is None and time.monotonic() < deadline, self.err.read_text()[-3000:]
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def _ownership(*paths: Path) -> dict:
    return {path: (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) for path in paths
            for info in [os.lstat(path)]}


def _refused(capsys, *args: str) -> str:
    code, out, err = _cli(capsys, *args)
    assert code == 2 and not out and len(err.splitlines()) == 1, (code, out, err)
    return err


def _attach(capsys, pid: int, *args: str) -> str:
    code, _, err = _cli(capsys, "attach", str(pid), *args)
    assert code == 0 and f"process {pid} recorded" in err and len(err.splitlines()) == 1, err
    return err


def _detach(capsys, pid: int) -> None:
    code, _, err = _cli(capsys, "detach", str(pid))
    assert code == 0 and "runs unrecorded" in err, err


@pytest.fixture(scope="module")
def shared():
    """A root-owned folder (0755) outside pytest's private one, which the other user can read: the model, and
    that user's home."""
    folder = Path(tempfile.mkdtemp(prefix="nxl-attach-root-"))
    folder.chmod(0o755)
    for path in save_chat_model(folder / MODEL_NAME).iterdir():
        path.chmod(0o644)  # safetensors writes its file 0600
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def user(shared):
    """A real unprivileged user, created for this module and removed after it: (name, uid, gid, home)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create another user")
    if trusted_file(str(SYSTEM_PYTHON), frozenset({0})) is None:
        pytest.skip(f"needs {SYSTEM_PYTHON}, root's own, for the other user's process")
    name = f"nxlt{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True, timeout=60)
    try:
        entry = pwd.getpwnam(name)
        home = shared / "home"
        home.mkdir()
        os.chown(home, entry.pw_uid, entry.pw_gid)
        yield name, entry.pw_uid, entry.pw_gid, home
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def user_target(user, shared):
    """The other user's process: the system Python reached through a link in that user's own folder, a
    sitecustomize of that user's faking the version, a model held and used in a loop."""
    name, uid, gid, home = user
    for folder in ("bin", "site", "tmp"):
        (home / folder).mkdir()
    (home / "bin" / "python").symlink_to(SYSTEM_PYTHON)
    (home / "site" / "sitecustomize.py").write_text(_FAKE_VERSION)
    (home / "target.py").write_text(_TARGET)
    # what the user's link will point to: writes the marker (into a folder only root may write) if root runs it
    evil = home / "bin" / "evil"
    evil.write_text(f"#!/bin/sh\ntouch {shared / 'MARKER'} 2>/dev/null\nexec {SYSTEM_PYTHON} \"$@\"\n")
    evil.chmod(0o755)
    for path in [home, *home.rglob("*")]:
        os.chown(path, uid, gid, follow_symlinks=False)
    packages = [str(REPO), str(home / "site"), *site.getsitepackages()]
    env = {"PATH": os.defpath, "HOME": str(home), "TMPDIR": str(home / "tmp"), "PYTHONPATH": os.pathsep.join(packages),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import torch, transformers, nxl_hooks"], env=env, user=name,
                           group=name, extra_groups=[], capture_output=True, text=True, timeout=240, cwd=home)
    if probe.returncode != 0:
        pytest.skip(f"the other user cannot import this environment's packages: {probe.stderr.strip()[-300:]}")
    (shared / "user-logs").mkdir()
    process = Process(shared / "user-logs", [str(home / "bin" / "python"), str(home / "target.py"), str(shared / MODEL_NAME)],
                      env, user=name)
    yield process
    process.stop()


def _own(folder: Path, model: Path) -> Process:
    """A process of this user (root here) holding ``model``."""
    folder.mkdir()
    (folder / "target.py").write_text(_TARGET)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return Process(folder, [sys.executable, str(folder / "target.py"), str(model)], env)


@pytest.fixture(scope="module")
def own_target(shared):
    """A process of this user (root here) holding the model under the escape-laden name."""
    process = _own(shared / "own", shared / MODEL_NAME)
    yield process
    process.stop()


def _popen_hook(monkeypatch, before) -> None:
    """Call ``before(args, kwargs)`` each time this process (nxl attach, in-process) starts a program as itself."""
    class Hooked(_POPEN):
        def __init__(self, args, *rest, **kwargs):
            if kwargs.get("user") is None:
                before(args, kwargs)
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Hooked)


# -- 1. root runs nothing of the user's ----------------------------------------------------------------------

def test_a_link_repointed_after_the_checks_and_a_faked_version_run_nothing_of_the_user(user_target, user, shared,
                                                                                        capsys, monkeypatch):
    _, uid, _, home = user
    link = home / "bin" / "python"

    def repoint(args, kwargs):  # the user, between nxl attach's checks and anything root starts
        link.unlink()
        link.symlink_to(home / "bin" / "evil")
        os.chown(link, uid, uid, follow_symlinks=False)

    _popen_hook(monkeypatch, repoint)
    try:
        code, _, err = _cli(capsys, "attach", str(user_target.pid), "--sink", str(shared / "run-a"))
        monkeypatch.undo()
        assert os.readlink(link) == str(home / "bin" / "evil")  # it was repointed before root started anything
        assert not (shared / "MARKER").exists()  # and root ran nothing of the user's
        assert code == 0 and f"process {user_target.pid} recorded" in err, err  # gdb, on the real interpreter
        assert f"live view as uid {uid}: nxl tail" in err  # its run folder and socket are that user's
        user_target.runs_on()
        _detach(capsys, user_target.pid)
    finally:
        monkeypatch.undo()
        link.unlink()
        link.symlink_to(SYSTEM_PYTHON)
    assert not (shared / "MARKER").exists()


def test_a_version_faked_by_the_users_sitecustomize_does_not_choose_the_route(user_target, shared, capsys,
                                                                              monkeypatch):
    started = []
    _popen_hook(monkeypatch, lambda args, kwargs: started.append(list(args)))
    _attach(capsys, user_target.pid, "--sink", str(shared / "run-b"))  # the real 3.x interpreter, through gdb
    monkeypatch.undo()
    assert started[-1][0] == "gdb"
    # root ran nothing but gdb: not even root's own interpreter file, which would load its standard library and
    # libpython from folders beside it that a user may be able to write (a root-installed Python's lib/)
    assert all(args[0] == "gdb" for args in started), started
    user_target.runs_on()
    _detach(capsys, user_target.pid)


# -- 2. --sink never hands root's files over -------------------------------------------------------------------

def test_sink_hands_over_only_a_folder_nxl_made_and_takes_it_back_on_failure(user_target, user, shared, capsys):
    _, uid, gid, _ = user
    existing, secret = shared / "existing", shared / "secret"
    existing.mkdir()
    (existing / "root-file").write_text("root's")
    secret.write_text("root's secret")
    secret.chmod(0o600)
    (existing / "link").symlink_to(secret)
    (shared / "linked").symlink_to(existing)
    paths = (existing, existing / "root-file", existing / "link", secret)
    before = _ownership(*paths)

    code, out, err = _cli(capsys, "attach", str(user_target.pid), "--sink", str(existing))
    assert _ownership(*paths) == before  # root's file, and the file its link names, are still root's
    assert code == 2 and not out and len(err.splitlines()) == 1 and "exists" in err and "new path" in err, err
    assert "symbolic link" in _refused(capsys, "attach", str(user_target.pid), "--sink", str(shared / "linked" / "r"))
    # in a folder the user owns, which they could swap for a link while root makes the run folder in it: refused
    # before anything is made there
    squat, made, mkdir = user[3], [], os.mkdir
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "mkdir", lambda path, *args, **kwargs: (made.append(str(path)), mkdir(path, *args, **kwargs)))
        assert f"which belongs to uid {uid}" in _refused(capsys, "attach", str(user_target.pid), "--sink",
                                                         str(squat / "runs" / "r"))
    assert not [path for path in made if path.startswith(str(squat))] and not (squat / "runs").exists()
    assert _ownership(*paths) == before and sorted(os.listdir(existing)) == ["link", "root-file"]

    run = existing / "run"  # a new folder: the only thing handed over
    _attach(capsys, user_target.pid, "--sink", str(run), "--listen", "127.0.0.1:0")
    assert _ownership(run)[run][:2] == (uid, gid) and _ownership(run / "token")[run / "token"][:2] == (uid, gid)
    user_target.runs_on()
    _detach(capsys, user_target.pid)
    assert _ownership(*paths) == before

    deeper = existing / "made" / "run"  # fails inside the target: the run folder and the folder above go
    err = _refused(capsys, "attach", str(user_target.pid), "--sink", str(deeper), "--models", "no-such-model")
    assert "no model matches" in err
    assert _ownership(*paths) == before and sorted(os.listdir(existing)) == ["link", "root-file", "run"]



NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to attach for another uid (65534)")
def test_a_folder_planted_above_the_sink_while_it_is_made_is_refused_never_followed(tmp_path, capsys, monkeypatch):
    """--sink STICKY/race/run, with race missing: another user plants STICKY/race (a link) right after nxl attach's
    checks. Root made the run folder through it, and its clean-up removed by path, through wherever the link led
    by then (here: root's own folder). Now every missing folder is made in the one above, held open: the link
    makes the attach refused, nothing is made or removed through it. With no link, what a failed attach made goes
    (through the descriptors held), after the run folder alone was handed over."""
    from nxl_hooks.apps.commands import attach
    from nxl_hooks.apps.serve import inject as injection, runs
    from nxl_hooks.apps.serve.inject import Target

    sticky, chosen, precious = tmp_path / "sticky", tmp_path / "chosen", tmp_path / "precious"
    sticky.mkdir()
    sticky.chmod(0o1777)
    chosen.mkdir()
    (precious / "run").mkdir(parents=True)
    (precious / "run" / "roots-data").write_text("root's")
    link, target = sticky / "race", Target(4242, NOBODY, NOBODY, sys.executable, (3, 11))
    monkeypatch.setattr(injection, "inspect_target", lambda pid: target)
    handed = []
    monkeypatch.setattr(injection, "inject", lambda *args, **kwargs: (
        handed.append(_ownership(sticky / "made", sticky / "made" / "run")), {"ok": False, "error": "refused"})[1])
    check_parents, prepare_run = runs.check_parents, attach.prepare_run

    def plant(path: str) -> None:
        link.unlink(missing_ok=True)
        link.symlink_to(path)
        os.lchown(link, NOBODY, NOBODY)

    def check_then_plant(folder):  # the other user, right after the checks
        check_parents(folder)
        plant(str(chosen))

    def repoint_then_prepare(*args, **kwargs):  # and again, before the run folder is looked up (and removed)
        plant(str(precious))
        return prepare_run(*args, **kwargs)

    monkeypatch.setattr(runs, "check_parents", check_then_plant)
    monkeypatch.setattr(attach, "prepare_run", repoint_then_prepare)
    err = _refused(capsys, "attach", "4242", "--sink", str(link / "run"))
    assert "appeared while nxl attach created it" in err and not handed
    assert os.listdir(chosen) == [] and os.listdir(precious / "run") == ["roots-data"]
    assert link.is_symlink()  # the user's: left as it is

    monkeypatch.setattr(runs, "check_parents", check_parents)
    monkeypatch.setattr(attach, "prepare_run", prepare_run)
    assert "refused" in _refused(capsys, "attach", "4242", "--sink", str(sticky / "made" / "run"))
    assert [{path: (uid, mode) for path, (uid, _, mode) in each.items()} for each in handed] == [
        {sticky / "made": (0, 0o711), sticky / "made" / "run": (NOBODY, 0o700)}]
    assert sorted(os.listdir(sticky)) == ["race"]  # both taken back


def _decoy(folder: Path) -> Path:
    """What another user may move into a folder root handed them (on the same file system): a folder of theirs
    that holds a folder of root's, whose file they cannot remove themselves. Returns that file."""
    precious = folder / "roots" / "precious"
    precious.parent.mkdir(parents=True)
    precious.write_text("root's")
    os.chown(folder, NOBODY, NOBODY)
    return precious


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to attach for another uid (65534)")
def test_a_failed_attach_takes_back_only_what_the_user_could_remove(tmp_path, capsys, monkeypatch):
    """The run folder handed over is the user's until the attach fails: they may move a folder of theirs into it
    that holds root's files. Root's clean-up removed the run folder whole (rmtree), root's files in it too; now it
    removes only what the user could have removed themselves, and leaves the rest (and so the run folder)."""
    from nxl_hooks.apps.serve import inject as injection
    from nxl_hooks.apps.serve.inject import Target

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    run = sticky / "made" / "run"
    monkeypatch.setattr(injection, "inspect_target", lambda pid: Target(4242, NOBODY, NOBODY, sys.executable, (3, 11)))
    precious = []

    def refused_after_a_move(*args, **kwargs):  # the user, while root waits for the process's answer
        assert _ownership(run)[run][0] == NOBODY
        precious.append(_decoy(run / "moved-in"))
        (run / "theirs").write_text("the user's")
        os.chown(run / "theirs", NOBODY, NOBODY)
        return {"ok": False, "error": "refused"}

    monkeypatch.setattr(injection, "inject", refused_after_a_move)
    assert "refused" in _refused(capsys, "attach", "4242", "--sink", str(run))
    assert precious[0].read_text() == "root's"  # root's file stays where the user put it
    assert sorted(os.listdir(run)) == ["moved-in"] and os.listdir(run / "moved-in") == ["roots"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to attach for another uid (65534)")
def test_the_request_folder_handed_over_is_never_removed_by_its_path(tmp_path, monkeypatch):
    """The request folder goes to the target's user, in sticky /tmp: they may rename it away and put a folder of
    theirs holding root's files at its path. Root's clean-up removed by that path (rmtree), root's files too; now
    it removes only what that user could have removed themselves."""
    from nxl_hooks.apps.serve import inject as injection
    from nxl_hooks.apps.serve.inject import Target

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(sticky))
    precious = []

    def swap_then_answer(target, bootstrap, patience):  # the user; then their process answers, as the script does
        folder, = [each for each in sticky.iterdir() if each.stat().st_uid == NOBODY]
        away = sticky / "away"
        folder.rename(away)
        decoy = sticky / "decoy"
        decoy.mkdir()
        _decoy(decoy)
        decoy.rename(folder)
        precious.append(folder / "roots" / "precious")
        (away / "request.json").rename(away / "request.json.taken")
        (away / "request.json.result").write_text('{"ok": true}')

    monkeypatch.setattr(injection, "_queue", swap_then_answer)
    target = Target(4242, NOBODY, NOBODY, sys.executable, (3, 11))
    assert injection.inject(target, {"action": "attach"}, timeout=30) == {"ok": True}
    assert precious[0].read_text() == "root's"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to attach for another uid (65534)")
def test_the_install_advice_for_another_users_process_runs_its_python_as_that_user(tmp_path, capsys, monkeypatch):
    """nxl_hooks missing in another user's process: the line told root to run that user's interpreter (a venv's,
    whose site-packages and .pth files are the user's) with pip, as root. It now says to run it as that user."""
    from nxl_hooks.apps.serve import inject as injection
    from nxl_hooks.apps.serve.inject import Target

    venv = "/home/someone/venv/bin/python"
    monkeypatch.setattr(injection, "inspect_target", lambda pid: Target(4242, NOBODY, NOBODY, sys.executable, (3, 11)))
    monkeypatch.setattr(injection, "inject", lambda *args, **kwargs: {
        "ok": False, "code": "not-installed", "executable": venv, "error": "nxl_hooks is not importable there"})
    err = _refused(capsys, "attach", "4242", "--sink", str(tmp_path / "run"))
    assert f"never as root: sudo -u '#{NOBODY}' {venv} -m pip install " in err, err


# -- 3. the target's words are escaped in root's terminal ------------------------------------------------------

def test_the_model_name_from_the_target_is_printed_escaped(own_target, shared, capsys):
    err = _attach(capsys, own_target.pid, "--sink", str(shared / "run-escape"))
    try:
        assert "\x1b" not in err and "\x07" not in err
        assert "tiny\\x1b[31mRED\\x1b]0;owned\\x07" in err
    finally:
        _detach(capsys, own_target.pid)


# -- 4. a concurrent tracer is waited for, then named ---------------------------------------------------------

def _hold_with_gdb(monkeypatch, pid: int, seconds: int, holders: list) -> None:
    """When nxl attach is about to start its gdb, another gdb (as a concurrent nxl attach's would) holds the
    target for ``seconds``."""

    def hold(args, kwargs):
        if args[0] == "gdb" and not holders:
            # nxl attach's own gdb settings: no symbols read (that took gdb seconds of CPU before it held still)
            holder = _POPEN(["gdb", "-p", str(pid), "--batch", "-nx", "-q", "-iex", "set auto-load off", "-iex",
                             "set auto-solib-add off", "-ex", f"shell sleep {seconds}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            holders.append(holder)
            deadline = time.monotonic() + 60
            while f"TracerPid:\t{holder.pid}\n" not in Path(f"/proc/{pid}/status").read_text():
                assert time.monotonic() < deadline and holder.poll() is None
                time.sleep(0.01)

    _popen_hook(monkeypatch, hold)


def test_a_concurrent_gdb_is_waited_for_then_named(own_target, shared, capsys, monkeypatch):
    holders: list[subprocess.Popen] = []
    _hold_with_gdb(monkeypatch, own_target.pid, 3, holders)
    try:
        _attach(capsys, own_target.pid, "--sink", str(shared / "run-wait"))  # after the other let go
        monkeypatch.undo()
        _detach(capsys, own_target.pid)
        holders.pop().wait(timeout=60)
        _hold_with_gdb(monkeypatch, own_target.pid, 8, holders)
        err = _refused(capsys, "attach", str(own_target.pid), "--timeout", "2", "--sink", str(shared / "run-named"))
        assert f"being traced by process {holders[0].pid} (gdb)" in err and "another nxl attach" in err, err
        assert "Operation not permitted" not in err and "as root" not in err
        assert not (shared / "run-named").exists()
    finally:
        monkeypatch.undo()
        for holder in holders:  # named: its sleep ended now, not waited out (gdb's batch then ends and detaches)
            for sleeper in psutil.Process(holder.pid).children(recursive=True):
                sleeper.terminate()
            holder.wait(timeout=60)
    own_target.runs_on()


def test_two_nxl_attach_at_once_one_records_the_other_says_why(own_target, shared, capsys):
    runs = [shared / "run-first", shared / "run-second"]
    commands = [subprocess.Popen([sys.executable, "-m", "nxl_hooks", "attach", str(own_target.pid), "--sink", str(run)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}) for run in runs]
    done = [(command.wait(timeout=300), *command.communicate(timeout=60)) for command in commands]
    try:
        assert sorted(code for code, _, _ in done) == [0, 2], done
        (_, _, lost), = [entry for entry in done if entry[0] == 2]
        assert len(lost.splitlines()) == 1 and ("recorded already" in lost or "being traced" in lost), lost
        assert "Operation not permitted" not in lost and "as root" not in lost
        assert [run.exists() for run in runs] == [code == 0 for code, _, _ in done]  # the loser left no folder
    finally:
        _detach(capsys, own_target.pid)


# -- 5. nothing in the target's stderr but nxl's own lines ---------------------------------------------------

def test_the_targets_stderr_holds_only_nxl_lines_after_attach_and_detach(shared, capsys):
    target = _own(shared / "quiet", shared / MODEL_NAME)  # a fresh one: a warning shows only the first time
    try:
        before = target.err.read_text()
        _attach(capsys, target.pid, "--sink", str(shared / "run-quiet"), "--layers", "all")
        target.runs_on()
        _detach(capsys, target.pid)
        target.runs_on()
        added = target.err.read_text()[len(before):]
    finally:
        target.stop()
    assert all(line.startswith("nxl") for line in added.splitlines()), added
