"""How the SLURM executor plugin reads job states: a cancelled job must count as failed.

snakemake-executor-plugin-slurm (2.4.0 up to 2.8.0, the newest when this was written) compares
the state `sacct` reports with its list of failure states by exact string. `sacct` reports a job
cancelled with `scancel` (pending or running) as ``CANCELLED by <uid>``, which matches nothing in
that list, so the plugin keeps the job "running" and the run waits forever with nothing queued.

``read_failure_states_by_base_name()``, called once from the Snakefile, wraps the plugin's status
query so that each suffixed form of a failure state (``CANCELLED by 0``, ``CANCELLED+``,
``TIMEOUT+``, lower case) reaches the plugin as the bare state. Nothing else changes: what the
plugin does with a state (report the failure, retries, excluding a failed node, waiting for SLURM
to requeue a preempted job) stays its own. It is applied only where it is known to be needed (and
where the hook is where we expect it); the unit test
``tests/test_slurm.py::test_upstream_plugin_still_keeps_cancelled_jobs_running`` fails the day
upstream reads these states itself, and then this module can go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.metadata
import inspect
import logging
import re
import shlex
from types import ModuleType

from packaging.version import Version

PLUGIN = "snakemake_executor_plugin_slurm"
PLUGIN_DISTRIBUTION = "snakemake-executor-plugin-slurm"
# Versions whose status query we wrap: checked in their source (same `query_job_status` hook,
# exact comparison with the failure list). Older ones query elsewhere; newer ones are probed.
KNOWN_AFFECTED = (Version("2.4.0"), Version("2.8.0"))
# SLURM's base states that end a job without success. PREEMPTED is here only so that its
# suffixed forms read as PREEMPTED too; the plugin's policy for it (wait for SLURM to requeue)
# is kept.
FAILURE_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                            "PREEMPTED", "TIMEOUT"})
MARK = "_vidlabel_base_states"  # set on our wrapper, so that it is never wrapped twice

_WORD = re.compile(r"\s*([A-Za-z_]+)")
log = logging.getLogger("snakemake.logging")  # Snakemake's own logger: its messages reach the user


def base_state(state: str) -> str:
    """The bare failure state in a suffixed or odd form (``CANCELLED by 0`` -> ``CANCELLED``);
    any other state unchanged."""
    match = _WORD.match(state)
    if match and match.group(1).upper() in FAILURE_STATES:
        return match.group(1).upper()
    return state


def _wrap(query):
    """The plugin's ``query_job_status(command, logger) -> (states | None, seconds | None)`` with
    every state passed through ``base_state``."""
    seen: set[tuple[str, str]] = set()
    announced = False

    @functools.wraps(query)
    async def query_job_status(*args, **kwargs):
        nonlocal announced
        result = await query(*args, **kwargs)
        logger = args[1] if len(args) > 1 else kwargs.get("logger", log)
        if not announced:  # once per run, on the first status query: the fix is in use
            announced = True
            logger.info("SLURM job states: suffixed failure states such as 'CANCELLED by <uid>' are read as "
                        "the bare state (vidlabel.core.slurm)")
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], dict)):
            return result  # a failed query (None, None): the plugin handles it
        states, seconds = result
        read = {}
        for job, state in states.items():
            read[job] = base_state(state) if isinstance(state, str) else state
            if read[job] != state and (job, state) not in seen:  # sacct lists finished jobs at every query
                seen.add((job, state))
                logger.info(f"SLURM job {job}: state {state!r} read as {read[job]!r}")
        return read, seconds

    setattr(query_job_status, MARK, True)
    return query_job_status


def _handles_suffixed_states(query) -> bool:
    """Whether the plugin's own status query already returns ``CANCELLED by 0`` as ``CANCELLED``
    (runs it on a ``printf`` line, in a thread of its own: an event loop may already run here)."""
    command = shlex.join(["printf", r"1|CANCELLED by 0\n"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        states, _ = pool.submit(asyncio.run, query(command, log)).result(timeout=60)
    return states == {"1": "CANCELLED"}


def read_failure_states_by_base_name(plugin: ModuleType | None = None, version: str | None = None) -> bool:
    """Wrap the SLURM plugin's status query (see the module docstring); True when it is wrapped.
    ``plugin`` and ``version`` default to the installed plugin (tests pass stand-ins)."""
    if plugin is None:
        try:
            plugin = importlib.import_module(PLUGIN)
            version = importlib.metadata.version(PLUGIN_DISTRIBUTION)
        except ImportError:
            return False  # no SLURM plugin, no SLURM runs: nothing to fix
    query = getattr(plugin, "query_job_status", None)
    if getattr(query, MARK, False):
        return True
    check = getattr(getattr(plugin, "Executor", None), "check_active_jobs", None)
    # The hook: the plugin's check_active_jobs calls the module-level query_job_status by name.
    code = getattr(check, "__code__", None)
    if not (inspect.iscoroutinefunction(query) and code is not None and "query_job_status" in code.co_names):
        log.warning(f"{PLUGIN_DISTRIBUTION} {version}: its job status query is not where vidlabel.core.slurm expects "
                    "it, so states like 'CANCELLED by <uid>' are read as the plugin reads them; if a job "
                    "cancelled with scancel keeps the run waiting, stop Snakemake and run the same command "
                    "again (docs/slurm.md)")
        return False
    installed = Version(version)
    if installed < KNOWN_AFFECTED[0]:
        log.warning(f"{PLUGIN_DISTRIBUTION} {version} is older than the versions vidlabel.core.slurm knows; "
                    f"its job states are read as the plugin reads them")
        return False
    if installed > KNOWN_AFFECTED[1]:
        try:
            handled = _handles_suffixed_states(query)
        except Exception as error:  # the hook's contract changed: leave the plugin alone
            log.warning(f"{PLUGIN_DISTRIBUTION} {version}: its job status query no longer works as "
                        f"vidlabel.core.slurm expects ({error!r}); its job states are read as the plugin reads them")
            return False
        if handled:
            log.warning(f"{PLUGIN_DISTRIBUTION} {version} reads 'CANCELLED by <uid>' as 'CANCELLED' itself: "
                        "vidlabel.core.slurm leaves it alone and can be removed")
            return False
        # A newer version that still passes the raw state on: reading the base state is harmless
        # even if it now matches states elsewhere, and without it a cancelled job hangs the run.
    plugin.query_job_status = _wrap(query)
    return True
