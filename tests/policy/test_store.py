import threading
from pathlib import Path

import pytest

from proxima.policy.loader import PolicyError, load_policy
from proxima.policy.store import FileWatcher, PolicyStore, merge_patch

CONFIGS = Path(__file__).parents[2] / "proxima" / "policies"


@pytest.fixture
def store() -> PolicyStore:
    return PolicyStore.from_file(CONFIGS / "balanced.yaml")


def test_swap_versions_history_and_diff(store: PolicyStore) -> None:
    v, changes = store.swap(load_policy(CONFIGS / "conservative.yaml"), "test")
    assert v.version == 2 and store.policy.name == "conservative"
    assert any(c.path == "name" and c.old == "balanced" and c.new == "conservative" for c in changes)
    assert [h.version for h in store.history()] == [1, 2]


def test_rejected_text_changes_nothing(store: PolicyStore) -> None:
    before = store.current
    with pytest.raises(PolicyError) as info:
        store.apply_text("name: x\nbands: [{name: a, enter: 2}]\n", "api")
    assert any(p.field.startswith("bands[0]") for p in info.value.problems)
    assert store.current is before and len(store.history()) == 1


def test_patch_merges_and_validates(store: PolicyStore) -> None:
    v, changes = store.patch({"budget": {"max_blocks_per_step": 7}}, "api")
    assert store.policy.budget.max_blocks_per_step == 7 and v.version == 2
    assert [c.path for c in changes] == ["budget.max_blocks_per_step"]
    with pytest.raises(PolicyError) as info:
        store.patch({"budget": {"max_blocks_per_step": -1}}, "api")
    assert info.value.problems[0].field == "budget.max_blocks_per_step"
    assert store.current.version == 2


def test_rollback_reinstalls_as_new_version(store: PolicyStore) -> None:
    store.patch({"budget": {"max_blocks_per_step": 7}}, "api")
    v, _ = store.rollback(1)
    assert v.version == 3 and v.source == "rollback:1"
    assert store.policy == store.history()[0].policy
    with pytest.raises(KeyError, match="no policy version 99"):
        store.rollback(99)


def test_merge_patch_rfc7386() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "d": 3}}) == {"a": {"c": 2, "d": 3}}
    assert merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}


def test_concurrent_patches_serialised(store: PolicyStore) -> None:
    def worker(i: int) -> None:
        for j in range(20):
            store.patch({"description": f"{i}-{j}"}, f"t{i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    versions = [h.version for h in store.history()]
    assert versions == list(range(versions[0], versions[0] + len(versions)))
    assert store.current.version == 81


def test_readers_see_whole_policies_during_swaps(store: PolicyStore) -> None:
    a = load_policy(CONFIGS / "conservative.yaml")
    b = load_policy(CONFIGS / "aggressive.yaml")
    stop = threading.Event()
    seen: set[tuple[str, int]] = set()

    def reader() -> None:
        while not stop.is_set():
            p = store.current.policy
            seen.add((p.name, p.budget.max_blocks_per_step))

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(200):
        store.swap(a, "t")
        store.swap(b, "t")
    stop.set()
    t.join()
    valid = {(p.name, p.budget.max_blocks_per_step) for p in (a, b, load_policy(CONFIGS / "balanced.yaml"))}
    assert seen <= valid  # never a name from one policy with a budget from another


def test_hot_reload_keeps_live_policy_on_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text((CONFIGS / "conservative.yaml").read_text())
    store = PolicyStore.from_file(path)
    errors: list[PolicyError] = []
    watcher = FileWatcher(store, path, on_error=errors.append)
    assert watcher.poll() is None  # unchanged
    path.write_text(path.read_text().replace("max_blocks_per_step: 512", "max_blocks_per_step: 64"))
    v = watcher.poll()
    assert v is not None and v.version == 2 and store.policy.budget.max_blocks_per_step == 64
    path.write_text("bands: [oops\n")
    assert watcher.poll() is None
    assert store.current.version == 2 and errors and "invalid YAML" in str(errors[0])
    assert watcher.last_error is errors[0]


def test_a_live_change_of_the_group_size_is_refused(store: PolicyStore) -> None:
    """Slots are laid out for the start-up quantization group: a new policy that changes it would
    make the stored blocks unreadable, so it never replaces the live one (also by patch)."""
    before = store.current
    with pytest.raises(PolicyError) as info:
        store.patch({"storage": {"group_size": 64}}, "api")
    [p] = info.value.problems
    assert p.field == "storage.group_size" and "fixed while serving: 32 at start-up, got 64" in p.message
    assert store.current is before and len(store.history()) == 1
    store.patch({"storage": {"group_size": 32}, "budget": {"max_blocks_per_step": 7}}, "api")  # unchanged: fine
    assert store.current.version == 2


def test_the_engines_requirements_refuse_a_candidate_and_change_nothing() -> None:
    from proxima.policy.loader import Problem

    store = PolicyStore(load_policy(CONFIGS / "conservative.yaml"))
    store.patch({"probes": {"drift": {"enabled": True}}}, "api")  # version 2: allowed, no requirement yet
    store.requirements = lambda p, src: (
        [Problem(src, None, None, "probes.drift.enabled", "no observer here")] if p.probes.drift.enabled else []
    )
    with pytest.raises(PolicyError, match="no observer here") as err:
        store.patch({"budget": {"max_blocks_per_step": 9}}, "api")  # drift still on in the merged policy
    assert err.value.problems[0].field == "probes.drift.enabled"
    with pytest.raises(PolicyError):
        store.rollback(2)
    assert store.current.version == 2
    store.patch({"probes": {"drift": {"enabled": False}}}, "api")
    assert store.current.version == 3 and not store.policy.probes.drift.enabled
