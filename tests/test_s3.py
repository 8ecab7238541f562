"""The MLflow artifact store in an S3 bucket through boto3, against a real S3-API server over
HTTP, with the credentials in a Prefect block: every artifact of the tiny pipeline goes to the
bucket (SFT from two DeepSpeed ranks started through a hostfile, rank 0 uploading), the reward
stage loads the SFT model back from it, the credentials never reach MLflow, and the copies the
stages download leave nothing behind. (test_serving.py
runs the MLflow server's S3 store with the credentials in its environment.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from leaks import leaks, mlflow_texts
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config

BUCKET = "rlhf-artifacts"
OVERRIDES = {
    "experiment": "rlhf-s3",  # an experiment's artifact location is fixed when it is created
    "sft": {"max_steps": 2, "launch": {"world_size": 2, "deepspeed": "zero2", "hostfile": "hostfile.local"}},
    "reward": {"max_steps": 2},
}
LEFT_IN_TEMP: dict[str, object] = {}  # what the S3 run left in its temp folder: name → its entries


@pytest.fixture(scope="module")
def temp_folder(tmp_path_factory) -> Path:
    """The temp folder of the S3 run: this process's and its children's (TMPDIR)."""
    return tmp_path_factory.mktemp("s3-run-tmp")


@pytest.fixture(scope="module")
def s3_run(prefect_server, s3_server, hh_file, temp_folder):
    from prefect_aws import AwsClientParameters, AwsCredentials

    s3_server.client().create_bucket(Bucket=BUCKET)
    AwsCredentials(aws_access_key_id=s3_server.credentials["AWS_ACCESS_KEY_ID"],
                   aws_secret_access_key=s3_server.credentials["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                   aws_client_parameters=AwsClientParameters(endpoint_url=s3_server.endpoint)).save("rlhf-s3-test")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RLHF_AWS_CREDENTIALS_BLOCK", "rlhf-s3-test")
        env.setenv("RLHF_ARTIFACTS", f"s3://{BUCKET}/mlflow")
        env.setenv("TMPDIR", str(temp_folder))
        env.setattr(tempfile, "tempdir", str(temp_folder))
        for key in s3_server.env:  # the flow sets them from the block; gone again after this module
            env.setenv(key, "")
        from flows.rlhf import rlhf

        run_id = rlhf(preset="tiny", overrides=OVERRIDES, stages=["data", "sft", "reward"])
        # What the run left there, before the tests read anything back (torch's compile cache is
        # one folder that every run reuses).
        LEFT_IN_TEMP.update({p.name: sorted(c.name for c in p.iterdir()) if p.is_dir() else "a file"
                             for p in temp_folder.iterdir() if not p.name.startswith("torchinductor_")})
        yield run_id


def _runs_and_versions(pipeline_run_id: str) -> tuple[list, list]:
    client = tracking.client()
    runs = [client.get_run(pipeline_run_id), *lineage.stage_runs(pipeline_run_id)]
    versions = []
    for key, uri in lineage.outputs_of(pipeline_run_id).items():
        if key.endswith("_model"):  # models:/<name>/<version>; `<kind>_model_artifact` is models:/<model id>
            name, version = uri.removeprefix("models:/").split("/")
            versions.append(client.get_model_version(name, version))
    return runs, versions


def test_every_artifact_is_in_the_bucket_and_models_load_back(s3_run, s3_server, rlhf_home):
    from stages.compute.reward.model import load_reward_model

    runs, versions = _runs_and_versions(s3_run)
    assert {run.data.tags.get("rlhf.stage") for run in runs[1:]} == {"data", "sft", "reward"}
    for run in runs:
        assert run.info.artifact_uri.startswith(f"s3://{BUCKET}/mlflow/rlhf-s3/{run.info.run_id}/"), run.info.artifact_uri
    assert len(versions) == 2 and all(v.source.startswith(f"s3://{BUCKET}/") for v in versions)
    assert not (rlhf_home / "mlartifacts" / "rlhf-s3").exists()

    outputs = lineage.outputs_of(s3_run)
    keys = set(s3_server.objects(BUCKET))
    for stage in ("sft", "reward"):  # each an MLflow model, logged by the stage's run
        model_id = outputs[f"{stage}_model_artifact"].removeprefix("models:/")
        assert tracking.client().get_logged_model(model_id).source_run_id == outputs[f"{stage}_run"]
        assert any(key.startswith(f"mlflow/rlhf-s3/models/{model_id}/artifacts/") and key.endswith("/model.safetensors")
                   for key in keys), model_id
    assert any(key.endswith("/artifacts/splits/sft.jsonl") for key in keys)

    sft = tracking.client().get_run(outputs["sft_run"])
    assert sft.data.params["sft.world_size"] == "2" and sft.data.params["sft.engine"] == "DeepSpeedEngine"
    # The reward stage trained on the SFT model it loaded from the bucket ...
    reward_version = next(v for v in versions if v.name == "rlhf-tiny-reward")
    assert reward_version.tags["rlhf.input.sft_model"] == outputs["sft_model"]
    # ... and its own registered version loads back from there.
    model = load_reward_model(tracking.download(outputs["reward_model"]), load_config("tiny").model)
    assert model.score_std > 0


def test_the_downloaded_copies_and_gate_reports_leave_nothing_in_the_temp_folder(s3_run):
    """Every stage reads its inputs (splits, models) and every gate its probes from the bucket: the
    copies are gone once they are read, as are the gates' Data Docs sites (a run of a large model
    would otherwise leave its models' weights in /tmp, run after run)."""
    assert LEFT_IN_TEMP == {}


def test_credentials_never_reach_mlflow(s3_run, s3_server):
    runs, versions = _runs_and_versions(s3_run)
    found = leaks(s3_server.credentials.values(), texts=mlflow_texts(runs, versions), blobs=s3_server.objects(BUCKET))
    assert found == []


def test_an_experiment_keeps_the_artifact_location_it_was_created_with(monkeypatch):
    client = tracking.client()
    monkeypatch.delenv("RLHF_ARTIFACTS", raising=False)
    tracking.experiment_id(client, "rlhf-local-artifacts")
    monkeypatch.setenv("RLHF_ARTIFACTS", f"s3://{BUCKET}/mlflow")
    with pytest.raises(ValueError, match="fixed when it is created"):
        tracking.experiment_id(client, "rlhf-local-artifacts")
