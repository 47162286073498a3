"""llmserve.model.memory: the memory a process may take under its cgroup's limit, read from cgroup folders
laid out as the kernel lays them out (v2, v1, hybrid; inside a container and on a host) in a tmp folder;
and the pre-load fit check (check_fits), which reads the same limit."""

from __future__ import annotations

import os

import psutil
import pytest

from llmserve.model.loader.build import RUNTIME, DoesNotFit, check_fits
from llmserve.model.memory import NO_LIMIT, available_memory, cgroup_memory_limit

MiB = 1 << 20
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def _cgroup(folder, **files) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name.replace("_", ".", 1)), "w") as f:
            f.write(f"{text}\n")
    return str(folder)


def _proc(tmp_path, *lines) -> str:
    path = tmp_path / "proc_self_cgroup"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def _v2(folder, max_, current, inactive_file=0, active_file=0, shmem=0) -> str:
    file = inactive_file + active_file + shmem
    return _cgroup(
        folder,
        memory_max=max_,
        memory_current=current,
        memory_stat=f"anon {current - file}\nfile {file}\nshmem {shmem}\ninactive_anon {shmem}\n"
        f"inactive_file {inactive_file}\nactive_file {active_file}",
    )


def _v1(folder, limit, usage, inactive_file=0, active_file=0) -> str:
    cache = inactive_file + active_file
    return _cgroup(
        folder,
        memory_limit_in_bytes=limit,
        memory_usage_in_bytes=usage,
        # the folder's own figures, then the hierarchy's (total_*): only the latter are read
        memory_stat=f"cache 0\nrss 0\ninactive_file 0\nactive_file 0\ntotal_cache {cache}\n"
        f"total_rss {usage - cache}\ntotal_inactive_file {inactive_file}\ntotal_active_file {active_file}",
    )


def test_v2_container_limit_less_its_working_set(tmp_path):
    """`podman run -m 1500m` on a cgroup v2 host: the container's cgroup is the mount's root; page cache
    the kernel reclaims first (active and inactive file pages) does not count as used, shared memory
    (on the anon lists, counted in `file` too) does."""
    root = tmp_path / "cg"
    _v2(root, 1500 * MiB, 900 * MiB, inactive_file=200 * MiB, active_file=100 * MiB, shmem=50 * MiB)
    got = cgroup_memory_limit(str(root), _proc(tmp_path, "0::/"))
    assert got is not None
    assert (got.path, got.limit, got.headroom) == (str(root), 1500 * MiB, 900 * MiB)


def test_v2_max_is_no_limit(tmp_path):
    root = tmp_path / "cg"
    _v2(root, "max", 700 * MiB)
    _v2(root / "user.slice", "max", 100 * MiB)
    proc = _proc(tmp_path, "0::/user.slice")
    assert cgroup_memory_limit(str(root), proc) is None
    host, limit = available_memory(str(root), proc)
    assert limit is None and host > 0


def test_v2_host_process_takes_the_tightest_ancestor(tmp_path):
    """A process on the host (no cgroup namespace): its own cgroup and every folder above it count; the
    one that leaves the least room wins, whichever level it is."""
    root = tmp_path / "cg"
    _v2(root / "system.slice", 4096 * MiB, 3900 * MiB)  # 196 MiB left: the tightest
    _v2(root / "system.slice" / "llm.service", 2048 * MiB, 500 * MiB)  # 1548 MiB left
    _v2(root / "system.slice" / "other.service", 64 * MiB, 60 * MiB)  # not this process's
    got = cgroup_memory_limit(str(root), _proc(tmp_path, "0::/system.slice/llm.service"))
    assert got is not None
    assert (got.path, got.limit, got.headroom) == (str(root / "system.slice"), 4096 * MiB, 196 * MiB)


def test_v1_container_sees_its_cgroup_at_the_mount(tmp_path):
    """cgroup v1 without a cgroup namespace (this machine's runc): /proc/self/cgroup names the host's path,
    absent inside the container, whose own memory cgroup is mounted at /sys/fs/cgroup/memory."""
    root = tmp_path / "cg"
    _v1(root / "memory", 1500 * MiB, 1000 * MiB, inactive_file=100 * MiB, active_file=400 * MiB)
    proc = _proc(tmp_path, "9:name=systemd:/libpod_parent/libpod-abc", "4:memory:/libpod_parent/libpod-abc", "0::/")
    got = cgroup_memory_limit(str(root), proc)
    assert got is not None
    assert (got.path, got.limit, got.headroom) == (str(root / "memory"), 1500 * MiB, 1000 * MiB)


def test_v1_hybrid_host_reads_the_memory_hierarchy_and_skips_unlimited(tmp_path):
    """A hybrid host (v1 controllers, v2 at unified/ without memory): v1's "unlimited" at the root is no
    limit; the process's own memory cgroup (a comma-joined controller list) sets it."""
    root = tmp_path / "cg"
    _v1(root / "memory", V1_UNLIMITED, 9000 * MiB)
    _v1(root / "memory" / "jobs", V1_UNLIMITED, 3000 * MiB)
    _v1(root / "memory" / "jobs" / "llm", 3 * 1024 * MiB, 1024 * MiB, inactive_file=24 * MiB)
    _cgroup(root / "unified", cgroup_procs="1")
    proc = _proc(tmp_path, "5:memory,hugetlb:/jobs/llm", "0::/jobs/llm")
    got = cgroup_memory_limit(str(root), proc)
    assert got is not None
    assert (got.path, got.limit, got.headroom) == (str(root / "memory" / "jobs" / "llm"), 3072 * MiB, 2072 * MiB)


def test_hybrid_unified_v2_limit_counts(tmp_path):
    root = tmp_path / "cg"
    _v2(root / "unified" / "box", 800 * MiB, 300 * MiB)
    got = cgroup_memory_limit(str(root), _proc(tmp_path, "0::/box"))
    assert got is not None and (got.limit, got.headroom) == (800 * MiB, 500 * MiB)


def test_unreadable_or_odd_values_are_no_limit(tmp_path):
    root = tmp_path / "cg"
    _cgroup(root, memory_max="")  # empty
    _cgroup(root / "a", memory_max=str(NO_LIMIT))  # huge
    _cgroup(root / "a" / "b", memory_max="-1")
    assert cgroup_memory_limit(str(root), _proc(tmp_path, "0::/a/b")) is None
    assert cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path / "no_proc_file")) is None


def test_working_set_over_the_limit_leaves_nothing(tmp_path):
    root = tmp_path / "cg"
    _v2(root, 100 * MiB, 120 * MiB)
    got = cgroup_memory_limit(str(root), _proc(tmp_path, "0::/"))
    assert got is not None and got.headroom == 0


def test_available_is_the_smaller_of_host_and_cgroup(tmp_path):
    """Under a limit tighter than the host's free RAM the cgroup decides; a limit above the host's free RAM
    (a large machine's slice) leaves the host's figure."""
    host = psutil.virtual_memory().available
    tight = tmp_path / "tight"
    _v2(tight, 1500 * MiB, 500 * MiB)
    got, limit = available_memory(str(tight), _proc(tmp_path, "0::/"))
    assert got == 1000 * MiB and limit is not None and limit.limit == 1500 * MiB

    loose = tmp_path / "loose"
    _v2(loose, host * 4, 0)
    got, limit = available_memory(str(loose), _proc(tmp_path, "0::/"))
    assert limit is None
    assert abs(got - psutil.virtual_memory().available) < host // 4  # the host's figure, read again


# -- the pre-load fit check (llmserve.model.loader.build.check_fits) reads the same limit -------------------
# the bundled SmolLM2-135M as served (bfloat16), and what its server has charged when the check runs, as the
# refusals in deploy/smoke.sh's image gave them (0.42 GiB left of 0.78 GiB, 0.47 of 0.83)
BUNDLED_WEIGHTS = 256 * MiB
CHARGED_AT_CHECK = 370 * MiB


def _container(tmp_path, limit_mib: int) -> tuple[str, str]:
    """cgroup v1 as runc lays it out for `podman run -m`, with the bundled model's server charged up to the
    check (some page cache on top, which does not count)."""
    root = tmp_path / f"cg{limit_mib}"
    _v1(root / "memory", limit_mib * MiB, CHARGED_AT_CHECK + 80 * MiB, inactive_file=50 * MiB, active_file=30 * MiB)
    return str(root), _proc(tmp_path, "4:memory:/libpod_parent/libpod-abc", "0::/")


def test_fit_check_refuses_under_a_limit_the_host_would_allow(tmp_path):
    """Under 800m, where the kernel would kill the server while it loads: refused before anything is
    allocated, the message naming the limit and where it is set; the host's free RAM (far more) does not
    decide."""
    root, proc = _container(tmp_path, 800)
    assert psutil.virtual_memory().available > BUNDLED_WEIGHTS + RUNTIME + 800 * MiB
    with pytest.raises(DoesNotFit) as e:
        check_fits("/models/smollm2.gguf", BUNDLED_WEIGHTS, 0, root, proc)
    msg = str(e.value)
    assert "does not fit in memory" in msg and "/models/smollm2.gguf" in msg
    assert f"under the cgroup memory limit of 0.78 GiB, {os.path.join(root, 'memory')}" in msg
    assert "raise the container's memory limit" in msg
    assert e.value.available == 430 * MiB and e.value.needed == BUNDLED_WEIGHTS + RUNTIME


def test_fit_check_admits_the_bundled_model_where_it_serves(tmp_path):
    """The allowance matches what the load needs on top of the charged process: 1100m, where the kernel
    kills the server while it loads, is refused; 1200m (and 1400m, the smoke's limit), where it loads and
    serves, is admitted; the KV cache asked for counts on top."""
    with pytest.raises(DoesNotFit):
        check_fits("bundled", BUNDLED_WEIGHTS, 0, *_container(tmp_path, 1100))
    check_fits("bundled", BUNDLED_WEIGHTS, 0, *_container(tmp_path, 1200))
    check_fits("bundled", BUNDLED_WEIGHTS, 0, *_container(tmp_path, 1400))
    with pytest.raises(DoesNotFit, match=r"the KV cache 0\.50 GiB"):
        check_fits("bundled", BUNDLED_WEIGHTS, 512 * MiB, *_container(tmp_path, 1400))


def test_fit_check_without_a_limit_reads_the_host(tmp_path):
    """No limit set: the host's available RAM decides; more than it is refused, naming the host's RAM."""
    root = tmp_path / "cg"
    _v2(root, "max", 100 * MiB)
    proc = _proc(tmp_path, "0::/")
    check_fits("small", 10 * MiB, 0, str(root), proc)
    host = psutil.virtual_memory().available
    with pytest.raises(DoesNotFit, match="the host's RAM") as e:
        check_fits("huge", host, 0, str(root), proc)
    assert e.value.needed == host + RUNTIME and "free memory" in str(e.value)
