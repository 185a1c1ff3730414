"""The ``cloud_tpu`` backend: Cloud TPU queued resources (spot, on-demand or reserved) through
``google-cloud-tpu``.

A slice is a queued resource whose startup script (``infra/tpu/startup.sh``) runs the node agent
on every host; ``start_job`` writes a job spec to the slice's control directory and ``job_state``
reads the job's status files and the node state. ``tpu_v2`` over REST (v2alpha1 is gRPC only)."""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import time
import uuid
from typing import Any

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.local import heartbeat_interval
from rlax_tasks.compute.tpu_types import UnknownAcceleratorError, slice_hosts
from rlax_tasks.compute.types import (
    MANAGED_LABEL,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    SliceHandle,
    SliceSpec,
    SliceState,
    has_labels,
    managed_labels,
)
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import SLICES

log = logging.getLogger(__name__)

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
DEFAULT_STARTUP_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "infra/tpu/startup.sh"
# node metadata keys read by the startup script / the node agent
MD_SLICE_ROOT = "rlax-slice-root"
MD_INSTANCE_ID = "rlax-instance-id"
MD_IMAGE = "rlax-image"
MD_ENTRYPOINT = "rlax-entrypoint"
MD_POLL = "rlax-agent-poll-s"
# the OAuth scope a TPU VM's service account gets: access decided by its IAM roles
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"

_QR_PROVISIONING = {"CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES"}
_NODE_PROVISIONING = {"CREATING", "STARTING", "RESTARTING", "REPAIRING", "REIMAGING", "UNHIDING"}


def local_run_root_error(run_root: str, api_endpoint: str | None) -> str | None:
    """Why TPU VMs cannot use ``run_root`` (a path on this machine, with the real API), or None:
    the rule both the backend and the DAG's plan apply."""
    if storage.is_gcs(run_root) or api_endpoint:
        return None
    return (
        f"{run_root!r} is a path on this machine, which TPU VMs cannot read: give a "
        "gs://bucket/prefix (a local path works only with the fake Cloud TPU API, api_endpoint)"
    )


class CloudTpuBackend:
    """Slices as Cloud TPU queued resources; jobs dispatched through the slice's control dir.

    ``image``: the runtime image TPU VMs pull (built from ``infra/Dockerfile`` with the ``tpu``
    extra); ``run_root``: ``gs://bucket/prefix`` (a local path only with the fake API);
    ``api_endpoint`` and ``anonymous`` point it at ``infra/fakes/cloud_tpu.py`` (http:// works)."""

    name = "cloud_tpu"

    def __init__(
        self,
        run_root: str,
        project: str = "",
        zone: str = "",
        image: str = "",
        entrypoint: list[str] | None = None,
        api_endpoint: str | None = None,
        anonymous: bool = False,
        startup_script_path: str | None = None,
        operation_timeout_s: float = 300.0,
        agent_poll_s: float = 2.0,
        credentials_file: str | None = None,
        credentials_info: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(run_root, str) or not run_root:
            raise ValueError("cloud_tpu backend: run_root must be a gs://bucket/prefix URI")
        if (unreadable := local_run_root_error(run_root, api_endpoint)) is not None:
            raise ValueError(f"cloud_tpu backend: run_root {unreadable}")
        self.run_root = run_root if storage.is_gcs(run_root) else os.path.abspath(run_root)
        if not isinstance(image, str) or not image.strip():
            raise ValueError(
                'cloud_tpu backend: set "image" (an extra of the compute Connection, or in '
                "RLAX_BACKEND_SETTINGS) to the runtime image "
                "TPU VMs pull (e.g. us-docker.pkg.dev/PROJECT/rlax/rlax-tasks:TAG)"
            )
        self.project, self.zone = project, zone
        self.image = image.strip()
        self.entrypoint = list(entrypoint) if entrypoint else ["rlax"]
        self.api_endpoint = api_endpoint
        self.anonymous = bool(anonymous)
        self.startup_script_path = startup_script_path or str(DEFAULT_STARTUP_SCRIPT)
        self.operation_timeout_s = float(operation_timeout_s)
        self.agent_poll_s = float(agent_poll_s)
        if credentials_info is not None and not isinstance(credentials_info, dict):
            raise ValueError("cloud_tpu backend: credentials_info must be a service account key")
        # a service account key (a Google Cloud Connection's key_path / keyfile_dict); neither:
        # Application Default Credentials
        self.credentials_file, self.credentials_info = credentials_file, credentials_info

    # ------------------------------------------------------------------ client
    @functools.cached_property
    def client(self):  # noqa: ANN201 - google.cloud.tpu_v2.TpuClient, imported lazily
        """The TPU API client (REST transport)."""
        # lazy: the Cloud TPU client stays out of the Airflow triggerer
        from google.api_core.client_options import ClientOptions
        from google.cloud import tpu_v2

        options = ClientOptions(api_endpoint=self.api_endpoint) if self.api_endpoint else None
        credentials = None
        if self.anonymous:
            # lazy: the Cloud TPU client stays out of the Airflow triggerer
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()
        elif self.credentials_info is not None or self.credentials_file:
            from google.oauth2 import service_account  # lazy: as above

            credentials = (
                service_account.Credentials.from_service_account_info(
                    self.credentials_info, scopes=[CLOUD_PLATFORM_SCOPE]
                )
                if self.credentials_info is not None
                else service_account.Credentials.from_service_account_file(
                    self.credentials_file, scopes=[CLOUD_PLATFORM_SCOPE]
                )
            )
        return tpu_v2.TpuClient(transport="rest", client_options=options, credentials=credentials)

    def _where(self, spec: SliceSpec) -> tuple[str, str]:
        project, zone = spec.project or self.project, spec.zone or self.zone
        if not project:
            raise ValueError(f"slice {spec.name}: project is empty (set it in the spec or backend)")
        if not zone:
            raise ValueError(f"slice {spec.name}: zone is empty (set it in the spec or backend)")
        return project, zone

    def _qr_name(self, spec: SliceSpec) -> str:
        project, zone = self._where(spec)
        return f"projects/{project}/locations/{zone}/queuedResources/{spec.name}"

    def _node_name(self, handle: SliceHandle) -> str:
        parent = handle.resource.split("/queuedResources/")[0]
        return f"{parent}/nodes/{handle.name}"

    # ------------------------------------------------------------------ slices
    def provision(self, spec: SliceSpec) -> SliceHandle:
        """Creates the queued resource (idempotent by name; a preempted/failed one is replaced)."""
        # lazy: the Cloud TPU client stays out of the Airflow triggerer
        from google.api_core import exceptions as gexc

        if not spec.runtime_version:
            raise ValueError(
                f"slice {spec.name}: runtime_version is required on cloud_tpu "
                "(e.g. 'v2-alpha-tpuv5-lite')"
            )
        name = self._qr_name(spec)
        try:
            existing = self.client.get_queued_resource(name=name)
        except gexc.NotFound:
            existing = None
        if existing is not None:
            handle = self._handle_from_qr(existing)
            state, why = self._slice_state(handle)
            if state in (SliceState.PROVISIONING, SliceState.READY):
                log.info("queued resource %s exists (%s)", name, state.value)
                return handle
            log.info("replacing queued resource %s: %s", name, why)
            self._delete(name)
        return self._create(spec, name)

    def _create(self, spec: SliceSpec, name: str) -> SliceHandle:
        # lazy: the Cloud TPU client stays out of the Airflow triggerer
        from google.api_core import exceptions as gexc
        from google.cloud import tpu_v2

        parent = name.split("/queuedResources/")[0]
        instance_id = uuid.uuid4().hex[:12]
        root = storage.join(self.run_root, spec.run_id, SLICES, spec.name, instance_id)
        try:
            script = pathlib.Path(self.startup_script_path).read_text()
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"cloud_tpu startup_script_path={self.startup_script_path!r} does not exist"
            ) from e
        node = tpu_v2.Node(
            accelerator_type=spec.accelerator_type,
            runtime_version=spec.runtime_version,
            labels=managed_labels(spec.labels),
            metadata={
                "startup-script": script,
                MD_SLICE_ROOT: root,
                MD_INSTANCE_ID: instance_id,
                MD_IMAGE: self.image,
                MD_ENTRYPOINT: json.dumps(self.entrypoint),
                MD_POLL: str(self.agent_poll_s),
            },
            scheduling_config=tpu_v2.SchedulingConfig(spot=spec.spot, reserved=spec.reserved),
        )
        if spec.network or spec.subnetwork:
            node.network_config = tpu_v2.NetworkConfig(
                network=spec.network, subnetwork=spec.subnetwork
            )
        if spec.service_account:
            node.service_account = tpu_v2.ServiceAccount(
                email=spec.service_account, scope=[CLOUD_PLATFORM_SCOPE]
            )
        qr = tpu_v2.QueuedResource(
            tpu=tpu_v2.QueuedResource.Tpu(
                node_spec=[
                    tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node_id=spec.name, node=node)
                ]
            )
        )
        if spec.spot:
            qr.spot = tpu_v2.QueuedResource.Spot()
        try:
            op = self.client.create_queued_resource(
                parent=parent, queued_resource_id=spec.name, queued_resource=qr
            )
            created = op.result(timeout=self.operation_timeout_s)
        except gexc.AlreadyExists:
            created = self.client.get_queued_resource(name=name)  # lost a race: same slice
        except gexc.InvalidArgument as e:
            raise ValueError(f"slice {spec.name}: the TPU API rejected it: {e.message}") from e
        log.info("created queued resource %s (instance %s)", name, instance_id)
        return self._handle_from_qr(created)

    def _handle_from_qr(self, qr: Any) -> SliceHandle:
        node_spec = qr.tpu.node_spec[0]
        node = node_spec.node
        parts = qr.name.split("/")
        project, zone = parts[1], parts[3]
        spec = SliceSpec(
            name=node_spec.node_id,
            accelerator_type=node.accelerator_type,
            runtime_version=node.runtime_version,
            spot="spot" in qr or bool(node.scheduling_config.spot),
            reserved=bool(node.scheduling_config.reserved),
            service_account=node.service_account.email,
            network=node.network_config.network,
            subnetwork=node.network_config.subnetwork,
            labels={k: v for k, v in node.labels.items() if k != MANAGED_LABEL},
            zone=zone,
            project=project,
        )
        return SliceHandle(
            backend=self.name,
            name=spec.name,
            root=node.metadata[MD_SLICE_ROOT],
            instance_id=node.metadata[MD_INSTANCE_ID],
            spec=spec.to_dict(),
            resource=qr.name,
        )

    def slice_state(self, handle: SliceHandle | dict) -> SliceState:
        return self._slice_state(SliceHandle.from_dict(handle))[0]

    def _slice_state(self, handle: SliceHandle) -> tuple[SliceState, str]:
        # lazy: the Cloud TPU client stays out of the Airflow triggerer
        from google.api_core import exceptions as gexc

        try:
            qr = self.client.get_queued_resource(name=handle.resource)
        except gexc.NotFound:
            return SliceState.DELETED, "queued resource not found"
        if qr.tpu.node_spec[0].node.metadata.get(MD_INSTANCE_ID) != handle.instance_id:
            return SliceState.DELETED, "queued resource was re-created since"
        qr_state = qr.state.state.name
        initiator = qr.state.state_initiator.name
        if qr_state in _QR_PROVISIONING:
            return SliceState.PROVISIONING, f"queued resource {qr_state}"
        if qr_state in ("SUSPENDING", "SUSPENDED"):
            return SliceState.PREEMPTED, f"queued resource {qr_state} by {initiator}"
        if qr_state == "FAILED":
            return SliceState.FAILED, f"queued resource FAILED by {initiator}"
        if qr_state == "DELETING":
            return SliceState.DELETED, "queued resource DELETING"
        # ACTIVE: the node decides
        try:
            node = self.client.get_node(name=self._node_name(handle))
        except gexc.NotFound:
            return SliceState.PREEMPTED, "queued resource ACTIVE but its node is gone"
        node_state = node.state.name
        if node_state == "READY":
            return SliceState.READY, "node READY"
        if node_state in _NODE_PROVISIONING:
            return SliceState.PROVISIONING, f"node {node_state}"
        return SliceState.PREEMPTED, f"node {node_state}"

    def teardown(self, handle: SliceHandle | dict) -> None:
        """Deletes the queued resource and its node (no error when it is already gone)."""
        handle = SliceHandle.from_dict(handle)
        self._delete(handle.resource)

    def _delete(self, name: str) -> None:
        # lazy: the Cloud TPU client stays out of the Airflow triggerer
        from google.api_core import exceptions as gexc
        from google.cloud import tpu_v2

        try:
            # force: delete the node with it (a suspended/active resource still holds one)
            request = tpu_v2.DeleteQueuedResourceRequest(name=name, force=True)
            op = self.client.delete_queued_resource(request=request)
            op.result(timeout=self.operation_timeout_s)
        except gexc.NotFound:
            return
        log.info("deleted queued resource %s", name)

    def list_slices(self, label_filter: dict[str, str] | None = None) -> list[SliceHandle]:
        """Queued resources in the backend's project/zone with all of ``label_filter``."""
        if not self.project or not self.zone:
            raise ValueError("cloud_tpu list_slices: set the backend's project and zone")
        parent = f"projects/{self.project}/locations/{self.zone}"
        out = []
        for qr in self.client.list_queued_resources(parent=parent):
            if not qr.tpu.node_spec:
                continue
            node = qr.tpu.node_spec[0].node
            if MD_INSTANCE_ID not in node.metadata:
                continue  # not created by RLAX
            if has_labels(node.labels, label_filter):
                out.append(self._handle_from_qr(qr))
        return out

    # ------------------------------------------------------------------ jobs
    def start_job(self, handle: SliceHandle | dict, job: JobSpec) -> JobHandle:
        """Submits ``job`` to the slice's agent (a job of that name still running is returned)."""
        handle = SliceHandle.from_dict(handle)
        _check_hosts(handle, job)
        state, why = self._slice_state(handle)
        if state is not SliceState.READY:
            raise RuntimeError(f"slice {handle.name} is {state.value} ({why}), not READY")
        jobs = storage.join(handle.root, "jobs")
        attempt, running = jobstatus.next_attempt(jobs, job.name, self.job_state)
        if running is not None:
            log.info("job %s already running on %s", job.name, handle.name)
            return running
        status_dir = storage.join(jobs, f"{job.name}.{attempt}")
        job_handle = JobHandle.submitted(self.name, job, handle, status_dir)
        env = job.process_env()
        jobstatus.write_json(
            storage.join(status_dir, jobstatus.SPEC),
            {
                "job": {**job.to_dict(), "env": env},
                "heartbeat_interval_s": heartbeat_interval(job.heartbeat_timeout_s),
                "handle": job_handle.to_dict(),
            },
        )
        log.info(
            "submitted job %s (attempt %d) to slice %s, hosts %s",
            job.name,
            attempt,
            handle.name,
            list(job.hosts),
        )
        return job_handle

    def job_state(self, job: JobHandle | dict) -> JobStatus:
        job = JobHandle.from_dict(job)
        status = jobstatus.read_group_status(
            job.status_dir, job.hosts, job.heartbeat_timeout_s, job.submitted_at
        )
        if status.exit_code is not None or status.state in (JobState.SUCCEEDED, JobState.FAILED):
            return status  # it ended by itself: its exit code says how
        # running, or lost without an exit code: a lost slice is the better explanation
        slice_state, why = self._slice_state(job.slice_handle)
        if slice_state is not SliceState.READY:
            return JobStatus(JobState.PREEMPTED, f"slice {job.slice_handle.name}: {why}")
        return status

    def stop_job(self, job: JobHandle | dict) -> None:
        """Asks the node agents to stop the job on every host of it (SIGTERM, then SIGKILL after
        their grace period)."""
        job = JobHandle.from_dict(job)
        jobstatus.write_json(storage.join(job.status_dir, jobstatus.STOP), {"time": time.time()})


def _check_hosts(handle: SliceHandle, job: JobSpec) -> None:
    """ValueError when ``job.hosts`` names a host the slice does not have."""
    accelerator = handle.slice_spec.accelerator_type
    try:
        n = slice_hosts(accelerator)
    except UnknownAcceleratorError:
        return  # a type the table does not know yet: the agents simply never see such hosts
    if max(job.hosts) >= n:
        raise ValueError(
            f"job {job.name}: hosts={list(job.hosts)} but slice {handle.name} ({accelerator}) "
            f"has {n} host(s), numbered 0 to {n - 1}"
        )
