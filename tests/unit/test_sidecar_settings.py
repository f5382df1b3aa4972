"""The sidecar's settings are declared once; the CRD, the command line and the config must agree with them."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from stowaway import cli, sidecar_settings
from stowaway.operator import injection
from stowaway.sidecar.config import SidecarConfig

CRD = Path(__file__).resolve().parents[2] / "charts" / "stowaway" / "crds" / "checkpointpolicies.yaml"


def spec_schema() -> dict[str, Any]:
    """The schema of a CheckpointPolicy's spec, as the chart's CRD declares it for the stored version."""
    crd = yaml.safe_load(CRD.read_text())
    (stored,) = [version for version in crd["spec"]["versions"] if version["storage"]]
    schema: dict[str, Any] = stored["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def crd_type(setting: sidecar_settings.PolicySetting) -> set[str]:
    """The CRD types whose every value the setting's command-line flag takes."""
    if isinstance(setting, sidecar_settings.Switch):
        return {"boolean"}
    return {"integer"} if setting.parse is int else {"integer", "number"}


def same(crd_value: object, declared: object) -> bool:
    """Equal as values, where True is not 1 (a boolean field's default must be a boolean)."""
    return isinstance(crd_value, bool) == isinstance(declared, bool) and crd_value == declared


def disagreements(schema: dict[str, Any], settings: tuple[sidecar_settings.PolicySetting, ...]) -> list[str]:
    """Where the CRD's spec schema and the declared settings a policy sets differ, one line each."""
    found = []
    for setting in settings:
        assert setting.policy is not None
        where, node = "spec", schema
        for key in setting.policy:
            if node.get("type") == "object" and where != "spec" and node.get("default") != {}:
                found.append(f"{where} has no default {{}}: a policy without it gets no default for {setting.flag}")
            where, node = f"{where}.{key}", (node.get("properties") or {}).get(key)
            if node is None:
                break
        if node is None:
            found.append(f"{where} is missing, which sets the sidecar's {setting.flag}")
            continue
        if node.get("type") not in crd_type(setting):
            found.append(f"{where} is of type {node.get('type')}, but {setting.flag} takes {sorted(crd_type(setting))}")
        declared = setting.default
        if isinstance(setting, sidecar_settings.Number) and setting.policy_default is not None:
            declared = setting.policy_default
        if not same(node.get("default"), declared):
            found.append(f"{where} defaults to {node.get('default')!r}, the declaration of {setting.flag} to "
                         f"{declared!r}")
        if isinstance(setting, sidecar_settings.Number):
            bounded = {"minimum": setting.least is not None or setting.above is not None,
                       "maximum": setting.most is not None}
            for end, sidecar_has_one in bounded.items():
                bound = node.get(end)
                if bound is None and sidecar_has_one:
                    found.append(f"{where} has no {end}, but {setting.flag} must be {setting.requirement}")
                elif bound is not None and not setting.admits(bound):
                    found.append(f"{where} admits {bound}, but {setting.flag} must be {setting.requirement}")
    return found


def test_the_crd_has_every_setting_a_policy_sets_with_the_sidecars_type_default_and_range() -> None:
    assert disagreements(spec_schema(), sidecar_settings.FROM_POLICY) == []


def without(path: tuple[str, ...], key: str) -> dict[str, Any]:
    schema = copy.deepcopy(spec_schema())
    node = schema
    for part in path:
        node = node["properties"][part]
    del node[key]
    return schema


def changed(path: tuple[str, ...], **values: Any) -> dict[str, Any]:
    schema = copy.deepcopy(spec_schema())
    node = schema
    for part in path:
        node = node["properties"][part]
    node.update(values)
    return schema


@pytest.mark.parametrize(("schema", "expected"), [
    (without(("alerting",), "properties"), "spec.alerting.staleAfterSeconds is missing, which sets the sidecar's "
     "--stale-after"),
    (without(("retention", "keepLast"), "default"), "spec.retention.keepLast defaults to None, the declaration of "
     "--keep-last to 3"),
    (changed(("sidecar", "metricsPort"), default=9090), "spec.sidecar.metricsPort defaults to 9090, the declaration "
     "of --metrics-port to 9464"),
    (changed(("persistence", "directIO"), default=1), "spec.persistence.directIO defaults to 1, the declaration of "
     "--no-direct-io to True"),
    (changed(("persistence", "concurrency"), type="number"), "spec.persistence.concurrency is of type number, but "
     "--persist-workers takes ['integer']"),
    (changed(("persistence", "directIO"), type="string"), "spec.persistence.directIO is of type string, but "
     "--no-direct-io takes ['boolean']"),
    (changed(("retention", "keepLast"), minimum=0), "spec.retention.keepLast admits 0, but --keep-last must be at "
     "least 1"),
    (without(("commitTimeoutSeconds",), "minimum"), "spec.commitTimeoutSeconds has no minimum, but --commit-timeout "
     "must be a positive number of seconds"),
    (without(("alerting",), "default"), "spec.alerting has no default {}: a policy without it gets no default for "
     "--stale-after"),
], ids=["field missing", "default missing", "default differs", "boolean default is a number", "integer becomes number",
        "type differs", "range wider than the sidecar's", "range unbounded", "object without default"])
def test_a_crd_that_disagrees_with_the_declarations_is_caught(schema: dict[str, Any], expected: str) -> None:
    assert disagreements(schema, sidecar_settings.FROM_POLICY) == [expected]


def test_every_field_of_the_sidecar_config_is_a_declared_setting_with_the_declared_default() -> None:
    fields = {field.name: field for field in dataclasses.fields(SidecarConfig)}
    assert set(fields) == {setting.name for setting in sidecar_settings.ALL}
    for setting in sidecar_settings.ALL:
        field = fields[setting.name]
        if isinstance(setting, sidecar_settings.Location):
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            assert required == setting.required, f"{setting.flag}: required on the command line and in the config"
        elif isinstance(setting, sidecar_settings.Repeated) or setting.default is None:
            assert field.default_factory is not dataclasses.MISSING, f"{setting.flag}: the config computes it"
        else:
            assert same(field.default, setting.default), setting.flag


POLICY_VALUES = {
    ("retention", "keepLast"): 7, ("retention", "keepEvery"): 50, ("commitTimeoutSeconds",): 45,
    ("alerting", "staleAfterSeconds"): 3600, ("persistence", "concurrency"): 9, ("sidecar", "metricsPort"): 9999,
    ("sidecar", "gracePeriodSeconds"): 30, ("persistence", "directIO"): False,
}


def test_the_injected_command_gives_the_sidecar_every_value_the_policy_sets() -> None:
    assert set(POLICY_VALUES) == {setting.policy for setting in sidecar_settings.FROM_POLICY}
    spec: dict[str, Any] = {"storage": {"persistentVolumeClaim": {"claimName": "ckpts", "subPath": ""}},
                            "sharedMemory": {"sizeLimit": "8Gi", "slotsPerRank": 2},
                            "sidecar": {"image": "", "resources": {}, "native": True},
                            "persistence": {"checksum": "xxh3-64"}, "retention": {}, "alerting": {}}
    for (*parents, key), value in POLICY_VALUES.items():
        node = spec
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    pod = {"metadata": {"generateName": "train-"}, "spec": {"containers": [{"name": "trainer", "image": "t"}]}}
    command = injection.build_patch(pod, "default", spec, "stowaway:test")["spec"]["initContainers"][0]["command"]
    assert command[:2] == ["stowaway", "sidecar"]
    args = cli.build_parser().parse_args(command[1:])
    config = SidecarConfig(**{s.name: getattr(args, s.name) for s in sidecar_settings.FROM_POLICY},
                           storage=args.storage, socket_path=args.socket_path, shm_dir=args.shm_dir)
    assert {s.policy: getattr(config, s.name) for s in sidecar_settings.FROM_POLICY} == POLICY_VALUES
    assert (config.storage, config.socket_path, config.shm_dir) == (
        Path(injection.STORAGE_PATH), Path(injection.SOCKET_PATH), Path(injection.SLOT_DIR))


OUT_OF_RANGE = [
    ({"keep_last": 0}, "--keep-last must be at least 1, got 0"),
    ({"keep_every": -1}, "--keep-every must be 0 (off) or positive, got -1"),
    ({"persist_workers": 0}, "--persist-workers must be at least 1, got 0"),
    ({"metrics_port": 65536}, "--metrics-port must be 0 (off) or a TCP port up to 65535, got 65536"),
    ({"stale_after": 0.0}, "--stale-after must be a positive number of seconds, above the job's save interval, "
     "got 0.0"),
    ({"commit_timeout": 0.0}, "--commit-timeout must be a positive number of seconds, got 0.0"),
    ({"grace_period": -1.0}, "--grace-period must be 0 or more seconds, got -1.0"),
    ({"bucket_keep_last": 0}, "--bucket-keep-last must be at least 1, got 0"),
    ({"bucket_keep_every": -5}, "--bucket-keep-every must be 0 (off) or positive, got -5"),
    ({"upload_concurrency": 0}, "--upload-concurrency must be at least 1, got 0"),
    ({"upload_part_bytes": 2**20}, "--upload-part-size must be between 5 MiB and 5 GiB (S3's part limits), "
     "got 1048576"),
    ({"upload_retry_timeout": 0.0}, "--upload-retry-timeout must be a positive number of seconds, got 0.0"),
    ({"upload_retry_interval": -1.0}, "--upload-retry-interval must be a positive number of seconds, got -1.0"),
]


def test_a_malformed_bucket_url_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="write s3://BUCKET or s3://BUCKET/PREFIX"):
        SidecarConfig(storage=Path("/s"), socket_path=Path("/s.sock"), shm_dir=Path("/m"), bucket="gs://b")


@pytest.mark.parametrize(("overrides", "message"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_refused_with_its_flag_what_it_takes_and_what_it_got(
        overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        SidecarConfig(storage=Path("/s"), socket_path=Path("/s.sock"), shm_dir=Path("/m"), **overrides)
    assert str(refused.value) == message


def test_the_table_above_covers_every_setting_with_limits() -> None:
    assert {name for overrides, _ in OUT_OF_RANGE for name in overrides} == {s.name for s in sidecar_settings.CHECKED}


def test_a_sidecar_given_neither_a_directory_nor_a_bucket_says_what_to_give() -> None:
    with pytest.raises(ValueError, match=r"give --storage DIR .*, --bucket s3://BUCKET/PREFIX, or both"):
        SidecarConfig(socket_path=Path("s.sock"), shm_dir=Path("shm"))
