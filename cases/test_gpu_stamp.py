"""scripts/gpu_stamp.sh: a GPU run names the commit it ran, and says so when the tree sent is
not that commit's (the scripts used to write git_dirty=False whatever was sent)."""
import shutil
import subprocess
from pathlib import Path

import pytest

STAMP = Path(__file__).resolve().parent.parent / "scripts" / "gpu_stamp.sh"


def _sh(cwd, command):
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True,
                          check=False)


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None or shutil.which("sha256sum") is None:
        pytest.skip("needs git and sha256sum")
    (tmp_path / "scripts").mkdir()
    shutil.copy(STAMP, tmp_path / "scripts" / "gpu_stamp.sh")
    (tmp_path / ".gitignore").write_text(".gpu/\n")
    (tmp_path / "op.py").write_text("x = 1\n")
    for command in ("git init -q", "git add -A",
                    "git -c user.name=t -c user.email=t@t commit -qm one"):
        assert _sh(tmp_path, command).returncode == 0
    return tmp_path


def _device_check(repo):
    out = _sh(repo, "source scripts/gpu_stamp.sh check; "
                    "echo \"$HARNESS_GIT_COMMIT $HARNESS_GIT_DIRTY\"")
    assert out.returncode == 0, out.stderr
    commit, dirty = out.stdout.split()
    return commit, dirty, out.stderr


def test_a_clean_tree_is_stamped_and_checks_clean(repo):
    made = _sh(repo, "bash scripts/gpu_stamp.sh")
    assert made.returncode == 0 and "stamped" in made.stdout, made.stderr
    head = _sh(repo, "git rev-parse HEAD").stdout.strip()
    assert _device_check(repo)[:2] == (head, "0")


def test_a_tree_with_changes_is_refused_and_a_changed_copy_reads_dirty(repo):
    assert _sh(repo, "bash scripts/gpu_stamp.sh").returncode == 0
    (repo / "op.py").write_text("x = 2\n")  # the fix not yet committed
    refused = _sh(repo, "bash scripts/gpu_stamp.sh")
    assert refused.returncode == 1 and "not committed" in refused.stderr
    _, dirty, said = _device_check(repo)  # the stamp made before the change
    assert dirty == "1" and "op.py" in said


def test_an_old_stamp_without_file_hashes_reads_dirty(repo):
    head = _sh(repo, "git rev-parse HEAD").stdout.strip()
    (repo / ".gpu").mkdir()
    (repo / ".gpu" / "commit").write_text(head + "\n")
    assert _device_check(repo)[:2] == (head, "1")


def test_no_stamp_names_no_commit(repo):
    """Without .gpu/commit the run is 'unstamped', never the device's own (stale) .git."""
    assert _device_check(repo)[:2] == ("unstamped", "1")


def _sparse_without_reports(repo):
    (repo / "reports").mkdir()
    (repo / "reports" / "run.jsonl").write_text("{}\n")
    for command in ("git add -A", "git -c user.name=t -c user.email=t@t commit -qm two",
                    "git sparse-checkout set --no-cone '/*' '!/reports/'"):
        done = _sh(repo, command)
        assert done.returncode == 0, done.stderr
    assert not (repo / "reports" / "run.jsonl").exists()


def test_reports_left_out_of_a_sparse_checkout_are_stamped_absent_and_the_code_checks_clean(
        repo):
    """reports/ may stay behind (room for two bundles in one upload); the code is stamped."""
    _sparse_without_reports(repo)
    made = _sh(repo, "bash scripts/gpu_stamp.sh")
    assert made.returncode == 0, made.stderr
    assert "(1 under reports/ not in the working tree" in made.stdout
    stamp = (repo / ".gpu" / "commit").read_text().splitlines()
    assert any(line.endswith("  op.py") for line in stamp)
    assert "absent reports/run.jsonl" in stamp
    head = _sh(repo, "git rev-parse HEAD").stdout.strip()
    assert _device_check(repo)[:2] == (head, "0")


def test_a_file_stamped_absent_that_is_there_reads_dirty(repo):
    """reports/ holds scripts that GPU scripts run: one stamped absent but present on the
    device (left from an earlier call, or sent after the stamp) is not the stamped tree's."""
    _sparse_without_reports(repo)
    assert _sh(repo, "bash scripts/gpu_stamp.sh").returncode == 0
    assert _sh(repo, "git sparse-checkout disable").returncode == 0
    (repo / "reports" / "run.jsonl").write_text("changed\n")
    _, dirty, said = _device_check(repo)
    assert dirty == "1" and "reports/run.jsonl: present, stamped absent" in said


def test_code_left_out_of_the_working_tree_is_refused(repo):
    """Only reports/ may stay behind: any other tracked file missing is refused, unstamped."""
    _sparse_without_reports(repo)
    assert _sh(repo, "git sparse-checkout set --no-cone '/*' '!/reports/' '!/op.py'"
               ).returncode == 0
    refused = _sh(repo, "bash scripts/gpu_stamp.sh")
    assert refused.returncode == 1 and "op.py" in refused.stderr
    assert not (repo / ".gpu" / "commit").exists()


@pytest.mark.parametrize("flag", ["--skip-worktree", "--assume-unchanged"])
def test_a_change_hidden_from_git_status_is_refused(repo, flag):
    """git status trusts these flags; the stamp compares each file with its blob."""
    assert _sh(repo, f"git update-index {flag} op.py").returncode == 0
    (repo / "op.py").write_text("x = 3\n")
    assert _sh(repo, "git status --porcelain").stdout == ""
    refused = _sh(repo, "bash scripts/gpu_stamp.sh")
    assert refused.returncode == 1 and "op.py" in refused.stderr, refused.stderr
    assert not (repo / ".gpu" / "commit").exists()


def test_names_with_spaces_are_stamped(repo):
    (repo / "a file.py").write_text("y = 1\n")
    for command in ("git add -A", "git -c user.name=t -c user.email=t@t commit -qm three"):
        assert _sh(repo, command).returncode == 0
    assert _sh(repo, "bash scripts/gpu_stamp.sh").returncode == 0
    assert _device_check(repo)[1] == "0"
    (repo / "a file.py").write_text("y = 2\n")
    _, dirty, said = _device_check(repo)
    assert dirty == "1" and "a file.py" in said
