"""The ``ray`` backend: slices as placement groups of an existing Ray cluster (GPU or TPU).

A slice is a detached placement group with one bundle per host (its CPUs, GPUs or TPU chips),
each host on a node of its own; the group's name holds the slice's spec and run root, so any
process can list it. A job runs ``<entrypoint> <argv>`` under the job runner (``compute.runner``)
in a detached actor (``ray_host.HostProcess``) pinned to the bundle of each of its hosts; its
state comes from those actors: a host whose actor died with its node is PREEMPTED. Status files
live under the slice's root as on the other backends (shared storage when the cluster has
several machines)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import tempfile
import time
from typing import Any

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.local import heartbeat_interval
from rlax_tasks.compute.ray_connect import RayBackendError, connect, import_ray
from rlax_tasks.compute.ray_host import HostProcess, free_coordinator_port, sees_path
from rlax_tasks.compute.tpu_types import UnknownAcceleratorError, tpu_type
from rlax_tasks.compute.types import (
    COORDINATOR_ADDRESS_ENV,
    COORDINATOR_PORT_ENV,
    HOST_ADDRESS_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    WORKER_ID_ENV,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    SliceHandle,
    SliceSpec,
    SliceState,
    coordinator_port,
    has_labels,
)
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import SLICES

log = logging.getLogger(__name__)

# a slice's placement group is named PG_PREFIX + JSON {"run_root", "spec"}: the same slice always
# gets the same name, which Ray keeps unique, and its handle can be rebuilt from the name
PG_PREFIX = "rlax-slice:"
# a job's actor on host K: ACTOR_PREFIX + "<slice instance>/<job>.<attempt>/<K>"
ACTOR_PREFIX = "rlax-job:"
_SHAPE_RE = re.compile(r"^(?:(?P<hosts>[1-9]\d*)x)?(?:cpu|gpu-(?P<gpus>[1-9]\d*))$")
# when two hosts end abnormally together, the more telling cause wins (as jobstatus ranks them)
_CAUSE_RANK = {JobState.FAILED: 1, JobState.PREEMPTED: 2}
STATUS_TIMEOUT_S = 10.0  # how long job_state waits for the hosts of a job to answer


@dataclasses.dataclass(frozen=True)
class SliceShape:
    """The hosts of a Ray slice and what each host's bundle holds besides its CPUs."""

    hosts: int
    resources: dict[str, float]


def slice_shape(accelerator_type: str) -> SliceShape:
    """``cpu``, ``gpu-G`` (G GPUs), either as ``NxTYPE`` for N hosts (``2xcpu``, ``8xgpu-8``),
    or a Cloud TPU type (``v5litepod-16``: 4 hosts of 4 chips); RayBackendError otherwise."""
    if m := _SHAPE_RE.match(accelerator_type):
        gpus = {"GPU": float(m["gpus"])} if m["gpus"] else {}
        return SliceShape(int(m["hosts"] or 1), gpus)
    try:
        tpu = tpu_type(accelerator_type)
    except UnknownAcceleratorError:
        raise RayBackendError(
            f"accelerator_type={accelerator_type!r} is not a Ray slice type: use cpu, gpu-G "
            "(G GPUs per host), NxTYPE for N hosts (2xcpu, 8xgpu-8) or a Cloud TPU type "
            "(v5litepod-16)"
        ) from None
    return SliceShape(tpu.hosts, {"TPU": float(tpu.chips_per_host)})


class RayBackend:
    """Slices as Ray placement groups, jobs as runner processes in actors on their bundles.

    ``run_root``: gs:// or a path every node sees (checked); ``address``: the GCS address
    (host:port), ``ray://`` or ``auto`` (default: RAY_ADDRESS, else auto); ``namespace``: where
    slices and actors are named; ``cpus_per_host``: CPUs per host's bundle; ``entrypoint``: the
    rlax command (default: ``python -m rlax_tasks.cli`` in each node's Python)."""

    name = "ray"

    def __init__(
        self,
        run_root: str,
        address: str = "",
        namespace: str = "rlax",
        cpus_per_host: float = 1.0,
        entrypoint: list[str] | None = None,
        stop_grace_s: float = 10.0,
        start_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if not isinstance(run_root, str) or not run_root:
            raise RayBackendError("ray backend: run_root must be a gs:// URI or a shared path")
        self.run_root = run_root if storage.is_gcs(run_root) else os.path.abspath(run_root)
        self.address = address or os.environ.get("RAY_ADDRESS", "") or "auto"
        if not isinstance(namespace, str) or not namespace:
            raise RayBackendError("ray backend: namespace must be a non-empty string")
        self.namespace = namespace
        if not cpus_per_host > 0:
            raise RayBackendError(f"ray backend: cpus_per_host={cpus_per_host!r} must be > 0")
        self.cpus_per_host = float(cpus_per_host)
        self.entrypoint = list(entrypoint) if entrypoint else None
        self.stop_grace_s = float(stop_grace_s)
        self.start_timeout_s = float(start_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._shared_with: frozenset[str] = frozenset()  # node ids seen to share the run root

    # ------------------------------------------------------------------ connection
    def _ray(self):  # noqa: ANN202 - the ray module, connected to this backend's cluster
        return connect(self.address, self.namespace, self.connect_timeout_s)

    # ------------------------------------------------------------------ slices
    def provision(self, spec: SliceSpec) -> SliceHandle:
        """Creates the slice's placement group (idempotent: a live slice of that name and run is
        returned); RayBackendError when the cluster's nodes cannot hold it."""
        ray = self._ray()
        self._check_shared_run_root(ray)
        spec = spec.managed()
        shape = slice_shape(spec.accelerator_type)
        if (existing := self._find(ray, spec)) is not None:
            return existing
        bundle = {"CPU": self.cpus_per_host, **shape.resources}
        _check_capacity(ray, spec, shape.hosts, bundle)
        name = PG_PREFIX + json.dumps(
            {"run_root": self.run_root, "spec": spec.to_dict()}, sort_keys=True
        )
        strategy = "STRICT_SPREAD" if shape.hosts > 1 else "PACK"
        try:
            pg = ray.util.placement_group(
                [bundle] * shape.hosts, strategy=strategy, name=name, lifetime="detached"
            )
        except ray.exceptions.RaySystemError:  # created meanwhile by another process
            if (existing := self._find(ray, spec)) is not None:
                return existing
            raise
        log.info(
            "ray slice %s: placement group %s, %d x %s", spec.name, pg.id.hex(), shape.hosts, bundle
        )
        return self._handle(pg.id.hex(), spec)

    def _check_shared_run_root(self, ray: Any) -> None:
        """RayBackendError when the run root is a local path that an alive node does not see
        (every host of a slice reads and writes it): checked with a file written here and looked
        for by a task on each node, again whenever a node joins."""
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        if storage.is_gcs(self.run_root) or len(nodes) < 2 or set(nodes) <= self._shared_with:
            return
        # lazy: Ray (see ray_connect.import_ray)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        os.makedirs(self.run_root, exist_ok=True)
        fd, marker = tempfile.mkstemp(prefix=".rlax-shared-check-", dir=self.run_root)
        os.close(fd)
        probe = ray.remote(num_cpus=0, max_retries=0)(sees_path)
        try:
            refs = [
                probe.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(marker)
                for node in nodes
            ]
            seen = ray.get(refs, timeout=self.start_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            log.warning("could not check that every Ray node sees %s: %s", self.run_root, e)
            return  # (a node left meanwhile: checked again at the next slice)
        finally:
            os.remove(marker)
        blind = [ip for ip, ok in zip(nodes.values(), seen, strict=True) if not ok]
        if blind:
            raise RayBackendError(
                f"ray backend: run_root {self.run_root} is a local path that Ray node(s) "
                f"{', '.join(blind)} cannot see ({len(blind)} of {len(nodes)}): put the run "
                "root on gs:// or on a path every node mounts (NFS, Filestore)"
            )
        self._shared_with = frozenset(nodes)

    def _handle(self, pg_id: str, spec: SliceSpec) -> SliceHandle:
        root = storage.join(self.run_root, spec.run_id, SLICES, spec.name, pg_id)
        return SliceHandle(self.name, spec.name, root, pg_id, spec.to_dict(), resource=pg_id)

    def _slices(self, ray: Any) -> list[tuple[SliceHandle, dict[str, Any]]]:
        """(handle, placement group row) of every live slice of this run root."""
        out = []
        for pg_id, row in ray.util.placement_group_table().items():
            if row["state"] == "REMOVED" or not row["name"].startswith(PG_PREFIX):
                continue
            record = json.loads(row["name"][len(PG_PREFIX) :])
            if record["run_root"] == self.run_root:
                out.append((self._handle(pg_id, SliceSpec.from_dict(record["spec"])), row))
        return out

    def _find(self, ray: Any, spec: SliceSpec) -> SliceHandle | None:
        for handle, _ in self._slices(ray):
            if handle.name == spec.name and handle.slice_spec.run_id == spec.run_id:
                return handle
        return None

    def _row(self, ray: Any, handle: SliceHandle) -> dict[str, Any] | None:
        """The placement group row of a slice, None once it is removed."""
        row = ray.util.placement_group_table().get(handle.instance_id)
        return row if row and row["state"] != "REMOVED" else None

    def slice_state(self, handle: SliceHandle | dict) -> SliceState:
        return _slice_state(self._row(self._ray(), SliceHandle.from_dict(handle)))

    def list_slices(self, label_filter: dict[str, str] | None = None) -> list[SliceHandle]:
        """The live slices of this run root whose labels include ``label_filter``."""
        handles = [h for h, _ in self._slices(self._ray())]
        return [h for h in handles if has_labels(h.spec["labels"], label_filter)]

    def teardown(self, handle: SliceHandle | dict) -> None:
        """Stops every job on the slice, then removes its actors and placement group."""
        ray = self._ray()
        handle = SliceHandle.from_dict(handle)
        actors = self._actors(ray, f"{ACTOR_PREFIX}{handle.instance_id}/")
        self._stop(ray, list(actors.values()), requested=True)
        for actor in actors.values():
            ray.kill(actor)
        if self._row(ray, handle) is not None:
            ray.util.remove_placement_group(_placement_group(ray, handle.instance_id))
        log.info("ray slice %s torn down (%d actor(s))", handle.name, len(actors))

    # ------------------------------------------------------------------ jobs
    def start_job(self, handle: SliceHandle | dict, job: JobSpec) -> JobHandle:
        """Starts ``job`` on each of its hosts (a job of that name still running is returned)."""
        ray = self._ray()
        handle = SliceHandle.from_dict(handle)
        row = self._row(ray, handle)
        state = _slice_state(row)
        if state is not SliceState.READY:
            raise RuntimeError(f"slice {handle.name} is {state.value}, not READY")
        if max(job.hosts) >= len(row["bundles"]):
            raise ValueError(
                f"job {job.name}: hosts={list(job.hosts)} but slice {handle.name} "
                f"({handle.slice_spec.accelerator_type}) has {len(row['bundles'])} host(s)"
            )
        jobs = storage.join(handle.root, "jobs")
        attempt, running = jobstatus.next_attempt(jobs, job.name, self.job_state)
        if running is not None:
            log.info("job %s already running on %s", job.name, handle.name)
            return running
        self._stop_and_kill(ray, f"{ACTOR_PREFIX}{handle.instance_id}/{job.name}.")
        job_handle = JobHandle.submitted(
            self.name, job, handle, storage.join(jobs, f"{job.name}.{attempt}")
        )
        nodes = _node_addresses(ray, row, job.hosts)
        if len(job.hosts) > 1 and COORDINATOR_PORT_ENV not in job.env:
            # a node may hold the hosts of several jobs (of several runs): the coordinator takes
            # a port free on its node now, not a fixed one another group may listen on
            port = self._free_port(ray, nodes[job.hosts[0]][0])
            job = JobSpec.from_dict({**job.to_dict(), "env": {**job.env,
                                     COORDINATOR_PORT_ENV: str(port)}})  # fmt: skip
        command = self._start_actors(ray, handle, job, job_handle, nodes)
        jobstatus.write_json(
            storage.join(job_handle.status_dir, jobstatus.SPEC),
            {
                "job": {**job.to_dict(), "env": job.process_env()},
                "command": command,
                "handle": job_handle.to_dict(),
                "nodes": {str(h): {"node_id": n, "address": a} for h, (n, a) in nodes.items()},
            },
        )
        log.info("started job %s on ray slice %s, hosts %s", job.name, handle.name, list(job.hosts))
        return job_handle

    def _free_port(self, ray: Any, node_id: str) -> int:
        """A TCP port free on Ray node ``node_id`` now (asked of a task on that node)."""
        # lazy: Ray (see ray_connect.import_ray)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray.remote(num_cpus=0, max_retries=0)(free_coordinator_port)
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return int(ray.get(probe.options(scheduling_strategy=strategy).remote(),
                           timeout=self.start_timeout_s))  # fmt: skip

    def _start_actors(
        self,
        ray: Any,
        handle: SliceHandle,
        job: JobSpec,
        job_handle: JobHandle,
        nodes: dict[int, tuple[str, str]],
    ) -> list[str]:
        """Creates the job's actor on each host's bundle and starts its process there; the
        command host 0 runs."""
        # lazy: Ray (see ray_connect.import_ray)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = _placement_group(ray, handle.instance_id)
        actor_class = _actor_class()
        leader = nodes[job.hosts[0]][1]
        interval = heartbeat_interval(job.heartbeat_timeout_s)
        actors, starts = [], []
        for host in job.hosts:
            actor = actor_class.options(
                name=_actor_name(job_handle, host),
                namespace=self.namespace,
                lifetime="detached",
                num_cpus=0,  # the slice's bundle holds the host; its jobs share it
                max_concurrency=8,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=host
                ),
            ).remote(jobstatus.host_status_dir(job_handle.status_dir, host))
            env = {**job.process_env(), **_group_env(job, host, nodes[host][1], leader)}
            actors.append(actor)
            starts.append(actor.start.remote(self.entrypoint, job.argv, env, interval))
        try:
            return ray.get(starts, timeout=self.start_timeout_s)[0]
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            for actor in actors:
                ray.kill(actor)
            raise RuntimeError(
                f"job {job.name} did not start on slice {handle.name}: {e}"
            ) from None

    def job_state(self, job: JobHandle | dict) -> JobStatus:
        """The job's state from its actors: a host's exit code, or PREEMPTED for a host whose
        actor is gone without one. Once the job ended, its other hosts are stopped."""
        ray = self._ray()
        job = JobHandle.from_dict(job)
        actors = {h: self._actor(ray, _actor_name(job, h)) for h in job.hosts}
        replies = {h: a.status.remote() for h, a in actors.items() if a is not None}
        if replies:  # a host that does not answer within the timeout reads as RUNNING
            ray.wait(list(replies.values()), num_returns=len(replies), timeout=STATUS_TIMEOUT_S)
        statuses = {h: self._host_status(ray, job, h, replies.get(h)) for h in job.hosts}
        status = _group_status(statuses)
        if status.state in (JobState.FAILED, JobState.PREEMPTED):
            for host, (host_status, _) in statuses.items():
                if host_status.state is JobState.RUNNING:  # its peer is gone: it would hang
                    actors[host].stop.remote(self.stop_grace_s, False)
        return status

    def _host_status(
        self, ray: Any, job: JobHandle, host: int, reply: Any
    ) -> tuple[JobStatus, float]:
        """(status, when it ended) of the job's process on ``host``."""
        if reply is not None:
            try:
                status, ended_at = ray.get(reply, timeout=0)
                return JobStatus.from_dict(status), ended_at or time.time()
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
                message = f"host {host} does not answer: {type(e).__name__}"
                return JobStatus(JobState.RUNNING, message), time.time()
            except ray.exceptions.RayActorError:
                pass  # died since it was looked up
        return self._lost_status(ray, job, host), 0.0  # the first cause of what follows

    def _lost_status(self, ray: Any, job: JobHandle, host: int) -> JobStatus:
        """A host whose actor is gone: its exit code if its runner wrote one, else stopped on
        request, else PREEMPTED (saying whether its node died)."""
        host_dir = jobstatus.host_status_dir(job.status_dir, host)
        if storage.exists(storage.join(host_dir, jobstatus.EXIT)):
            return jobstatus.read_job_status(host_dir, job.heartbeat_timeout_s, job.submitted_at)
        if any(storage.exists(storage.join(d, jobstatus.STOP)) for d in (job.status_dir, host_dir)):
            return JobStatus(JobState.FAILED, "stopped by request")
        spec = jobstatus.read_json(storage.join(job.status_dir, jobstatus.SPEC)) or {}
        node = spec.get("nodes", {}).get(str(host), {})
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        if node and node["node_id"] not in alive:
            why = f"its Ray node {node['address']} ({node['node_id'][:12]}) died"
        else:
            why = "its Ray actor is gone"
        return JobStatus(JobState.PREEMPTED, f"lost: {why}")

    def stop_job(self, job: JobHandle | dict) -> None:
        """Stops the job's process on every host (SIGTERM, SIGKILL after ``stop_grace_s``)."""
        ray = self._ray()
        job = JobHandle.from_dict(job)
        jobstatus.write_json(storage.join(job.status_dir, jobstatus.STOP), {"time": time.time()})
        actors = [self._actor(ray, _actor_name(job, h)) for h in job.hosts]
        self._stop(ray, [a for a in actors if a is not None], requested=True)

    # ------------------------------------------------------------------ actors
    def _actor(self, ray: Any, name: str) -> Any:
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:  # gone (or never created)
            return None

    def _actors(self, ray: Any, prefix: str) -> dict[str, Any]:
        """{name: actor} of the live actors of this namespace whose name starts with ``prefix``."""
        names = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
        found = {n: self._actor(ray, n) for n in names}
        return {n: a for n, a in found.items() if a is not None}

    def _stop(self, ray: Any, actors: list[Any], requested: bool) -> None:
        """Stops the processes of ``actors`` and waits until they ended (SIGKILL after the
        grace period)."""
        for actor in actors:
            actor.stop.remote(self.stop_grace_s, requested)
        waits = [actor.wait.remote(self.stop_grace_s + 5.0) for actor in actors]
        try:
            ray.get(waits, timeout=self.stop_grace_s + 10.0)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            log.warning("stopping %d process(es): %s", len(actors), e)

    def _stop_and_kill(self, ray: Any, prefix: str) -> None:
        """Stops the processes of the actors named ``prefix...`` and kills the actors."""
        actors = list(self._actors(ray, prefix).values())
        self._stop(ray, actors, requested=False)
        for actor in actors:
            ray.kill(actor)


@functools.cache
def _actor_class() -> Any:
    return import_ray().remote(HostProcess)


def _placement_group(ray: Any, pg_id: str) -> Any:
    from ray.util.placement_group import PlacementGroup  # lazy: Ray (see ray_connect.import_ray)

    return PlacementGroup(ray.PlacementGroupID.from_hex(pg_id))


def _actor_name(job: JobHandle, host: int) -> str:
    job_dir = job.status_dir.rstrip("/").rsplit("/", 1)[-1]  # "<job>.<attempt>"
    return f"{ACTOR_PREFIX}{job.slice_handle.instance_id}/{job_dir}/{host}"


def _slice_state(row: dict[str, Any] | None) -> SliceState:
    """READY once Ray placed the group; PROVISIONING while it places it (PENDING, PREPARED) or
    re-places the bundles of a lost node (RESCHEDULING); DELETED once removed."""
    if row is None:
        return SliceState.DELETED
    return SliceState.READY if row["state"] == "CREATED" else SliceState.PROVISIONING


def _check_capacity(ray: Any, spec: SliceSpec, hosts: int, bundle: dict[str, float]) -> None:
    """RayBackendError naming the first resource that too few of the cluster's nodes have."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    for resource, amount in bundle.items():
        have = [node.get(resource, 0.0) for node in nodes]
        fit = sum(h >= amount for h in have)
        if fit < hosts:
            each = f"each of its {hosts} hosts asks" if hosts > 1 else "its host asks"
            raise RayBackendError(
                f"slice {spec.name} ({spec.accelerator_type}): {each} for {resource}: "
                f"{amount:g} on a node of its own, but {fit} of the cluster's {len(nodes)} "
                f"node(s) have that much (the cluster has {resource}: {sum(have):g} in all, at "
                f"most {max(have, default=0.0):g} on a node)"
            )


def _node_addresses(
    ray: Any, row: dict[str, Any], hosts: tuple[int, ...]
) -> dict[int, tuple[str, str]]:
    """{host: (node id, node IP as Ray reports it)} of the bundles of ``hosts``."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {h: (row["bundles_to_node_id"][h], ips[row["bundles_to_node_id"][h]]) for h in hosts}


def _group_env(job: JobSpec, host: int, address: str, leader: str) -> dict[str, str]:
    """What the process on ``host`` learns of its group (as the node agent's ``_group_env``)."""
    out = {WORKER_ID_ENV: str(host), HOST_ADDRESS_ENV: address}
    if len(job.hosts) > 1:
        leader = f"[{leader}]" if ":" in leader else leader
        out[PROCESS_ID_ENV] = str(job.hosts.index(host))
        out[NUM_PROCESSES_ENV] = str(len(job.hosts))
        out[COORDINATOR_ADDRESS_ENV] = f"{leader}:{coordinator_port(job.env)}"
    return out


def _group_status(statuses: dict[int, tuple[JobStatus, float]]) -> JobStatus:
    """One job's state from its hosts' (as ``jobstatus.read_group_status``): SUCCEEDED when all
    exited 0; once one ended abnormally, a configuration error on any host, else the first."""
    if len(statuses) == 1:
        return next(iter(statuses.values()))[0]
    ended = []
    for host, (status, when) in statuses.items():
        if status.state in _CAUSE_RANK:
            rank = 0 if status.is_config_error else _CAUSE_RANK[status.state]
            ended.append((rank > 0, when, rank, host, status))
    if ended:
        *_, host, status = min(ended)
        more = f" ({len(ended) - 1} other host(s) ended too)" if len(ended) > 1 else ""
        return JobStatus(status.state, f"host {host}: {status.message}{more}", status.exit_code)
    running = sum(s.state is JobState.RUNNING for s, _ in statuses.values())
    if running:
        return JobStatus(JobState.RUNNING, f"{running} of {len(statuses)} hosts running")
    return JobStatus(JobState.SUCCEEDED, f"exit code 0 on all {len(statuses)} hosts", 0)
