"""A Hugging Face Hub name that cannot be loaded: angle-train and angle-eval say in one line which flag named it and
why (the Hub out of reach and the name not cached; no such repository), not transformers' or datasets' words alone.

No network: the tests run with HF_HUB_OFFLINE=1 (the root conftest.py), where the real loaders fail at once for a
name that was never downloaded; the Hub's other answers are the real exception types, raised where huggingface_hub
raises them for transformers (transformers.utils.hub's hf_hub_download) or as datasets raises them."""

import os
import sys

import huggingface_hub
import huggingface_hub.errors as hub_errors
import pytest
import transformers
import transformers.utils.hub

from angle_train import cli, evaluate, hub
from angle_train.config import TrainConfig
from angle_train.models import load_encoder
from angle_train.trainer import train

MODEL = "angle-kernels-tests/no-such-model"  # never downloaded: not in any cache
DATASET = "angle-kernels-tests/no-such-dataset"
PROGRAMS = {"angle-train": cli.main, "angle-eval": evaluate.main}
STS = "".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{i * 0.9:.3f}\ttext {i}\tother text {i}\n" for i in range(4))


def one_line_error(program: str, argv, capsys) -> str:
    """The one line `PROG: error: ...` the program's main(argv) ends with (status 2, no traceback; angle-eval may
    say which model it loads on a line before)."""
    with pytest.raises(SystemExit) as exit_info:
        PROGRAMS[program](argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith(f"{program}: error: ")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err
    return errors[0]


def train_argv(tmp_path, *flags):
    return ["--output-dir", str(tmp_path / "out"), "--device", "cpu", "--progress", "0", *flags]


def response(status: int, url: str):
    """An HTTP response as the installed huggingface_hub's errors take it (httpx, httpx2 or requests)."""
    response_type = hub_errors.Response
    package = sys.modules[response_type.__module__.split(".")[0]]
    if package.__name__ == "requests":
        answer = response_type()
        answer.status_code, answer.url = status, url
        return answer
    return response_type(status, request=package.Request("GET", url))


def repository_not_found(name: str):
    return hub_errors.RepositoryNotFoundError(f"404 Client Error. Repository Not Found for url: {name}",
                                              response=response(404, f"https://huggingface.co/api/models/{name}"))


@pytest.fixture
def hub_has_no_such_repository(monkeypatch):
    """transformers' downloads answered as the Hub answers a name it has no repository of."""
    def download(repo_id, *args, **kwargs):
        raise repository_not_found(repo_id)

    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", download)
    monkeypatch.setattr(transformers.utils.hub, "snapshot_download", download)


def test_offline_mode_is_on_for_these_tests():
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # the root conftest.py; else the loaders would retry


def test_train_model_not_cached_offline_names_the_flag(tmp_path, capsys):
    line = one_line_error("angle-train", train_argv(tmp_path, "--model", MODEL), capsys)
    assert f"--model {MODEL}: the Hugging Face Hub could not be reached (HF_HUB_OFFLINE=1 is set" in line
    assert "the model is not in the local Hugging Face cache (HF_HOME=" in line or "(HF_HUB_CACHE=" in line
    assert "download it once with network" in line


@pytest.mark.parametrize("flags, flag", [
    (["--train-data", DATASET], "--train-data"),
    (["--dev-data", DATASET], "--dev-data"),
    (["--objective", "arccse", "--train-data", DATASET], "--train-data"),  # its sentences, read by arccse.py
])
def test_train_dataset_not_cached_offline_names_the_flag(flags, flag, tmp_path, capsys):
    line = one_line_error("angle-train", train_argv(tmp_path, *flags), capsys)
    assert f"{flag} {DATASET}: the Hugging Face Hub could not be reached (HF_HUB_OFFLINE=1 is set" in line
    assert "the dataset is not in the local Hugging Face cache" in line


def test_eval_model_not_cached_offline_names_model(tmp_path, capsys):
    (tmp_path / "sts-test.csv").write_text(STS, encoding="utf-8")
    line = one_line_error("angle-eval", [MODEL, str(tmp_path / "sts-test.csv"), "--device", "cpu"], capsys)
    assert f"MODEL {MODEL}: the Hugging Face Hub could not be reached" in line


@pytest.mark.parametrize("base_flag", [False, True])
@pytest.mark.parametrize("folder", ["adapter", "best"])
def test_eval_adapter_base_not_cached_names_where_the_base_came_from(folder, base_flag, tmp_path, capsys):
    """A peft adapter folder (its adapter_config.json records the base model), and a LoRA run's best/ (the adapter
    alone, its angle_train.json recording the base model): the base named as --base-model gave it, else as the file
    that records it."""
    adapter = tmp_path / folder
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(f'{{"peft_type": "OTHER", "base_model_name_or_path": "{MODEL}"}}')
    if folder == "best":
        (adapter / "angle_train.json").write_text(f'{{"adapter_only": true, "lora": true, "base_model": "{MODEL}", '
                                                  '"pooling": "cls", "is_decoder": false}')
        (adapter / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n")  # an export keeps the tokenizer's files
    (tmp_path / "sts-test.csv").write_text(STS, encoding="utf-8")
    argv = [str(adapter), str(tmp_path / "sts-test.csv"), "--device", "cpu"]
    line = one_line_error("angle-eval", argv + (["--base-model", MODEL] if base_flag else []), capsys)
    record = f"{adapter / 'angle_train.json'}" if folder == "best" else f"MODEL {adapter}'s adapter_config.json"
    named = f"--base-model {MODEL}" if base_flag else f"{record} records the base model {MODEL}"
    assert f"{named}: the Hugging Face Hub could not be reached" in line


def test_no_such_model_repository_names_the_flag(hub_has_no_such_repository, tmp_path, capsys):
    line = one_line_error("angle-train", train_argv(tmp_path, "--model", MODEL), capsys)
    assert (f"--model {MODEL}: neither a local folder (there is none at {os.path.abspath(MODEL)}) nor a model "
            "repository on the Hugging Face Hub") in line


def test_no_such_dataset_repository_names_the_flag(tmp_path, capsys, monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def load_dataset(path, *args, **kwargs):  # as datasets.load raises it on the Hub's answer
        try:
            raise repository_not_found(path)
        except hub_errors.RepositoryNotFoundError as exc:
            raise DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub or cannot be accessed.") from exc

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    line = one_line_error("angle-train", train_argv(tmp_path, "--train-data", DATASET), capsys)
    assert f"--train-data {DATASET}: neither a local file or folder (there is none at " in line
    assert "nor a dataset repository on the Hugging Face Hub" in line


def test_invalid_repository_id_names_the_flag(tmp_path, capsys):
    line = one_line_error("angle-train", train_argv(tmp_path, "--model", "no such model"), capsys)
    assert "--model no such model: neither a local folder" in line
    assert "nor a valid Hugging Face Hub repository id" in line


def test_network_down_says_why_and_how_to_skip_the_retries(tmp_path, capsys, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) and no network: the Hub's error at the bottom, and HF_HUB_OFFLINE=1 advised."""
    client = sys.modules[hub_errors.Response.__module__.split(".")[0]]

    def from_pretrained(name, *args, **kwargs):  # transformers' words, raised from huggingface_hub's, as it does
        try:
            try:
                raise client.ConnectError("[Errno -2] Name or service not known")
            except client.ConnectError as exc:
                raise hub_errors.LocalEntryNotFoundError("cannot find the requested files in the local cache") \
                    from exc
        except hub_errors.LocalEntryNotFoundError as exc:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                          "in the cached files.") from exc

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    line = one_line_error("angle-train", train_argv(tmp_path, "--model", MODEL), capsys)
    assert (f"--model {MODEL}: the Hugging Face Hub could not be reached ([Errno -2] Name or service not known), "
            "and the model is not in the local Hugging Face cache") in line
    assert "set HF_HUB_OFFLINE=1 to skip the Hub and its retries" in line


def test_debug_shows_the_libraries_error_as_the_cause(tmp_path):
    with pytest.raises(hub.HubUnreachable) as raised:
        cli.main(train_argv(tmp_path, "--model", MODEL, "--debug", "1"))
    assert isinstance(raised.value, ConnectionError)
    assert isinstance(raised.value.__cause__, OSError)  # transformers' own, kept


def test_python_api_names_the_setting_or_argument(tmp_path):
    with pytest.raises(hub.HubUnreachable, match=f"--model {MODEL}: the Hugging Face Hub could not be reached"):
        train(TrainConfig(model=MODEL, output_dir=str(tmp_path / "out"), device="cpu", progress=False))
    with pytest.raises(ConnectionError, match=f"name_or_path={MODEL}: the Hugging Face Hub could not be reached"):
        load_encoder(MODEL)


def test_local_folder_errors_are_not_reworded(tmp_path, capsys, monkeypatch):
    """A name that is a local path is loaded as before: its error is the library's, not a word about the Hub."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert"}')
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n")

    def from_pretrained(name, *args, **kwargs):
        raise OSError(f"{name} holds a damaged file") from hub_errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    line = one_line_error("angle-train", train_argv(tmp_path, "--model", str(folder)), capsys)
    assert line.endswith(f"{folder} holds a damaged file")


def test_hub_lookup_leaves_other_errors_alone(tmp_path):
    gated = hub_errors.GatedRepoError("gated: ask for access", response=response(403, "https://huggingface.co/x"))
    with pytest.raises(hub_errors.GatedRepoError):  # its own message says how to get access
        with hub.hub_lookup(MODEL, given_as="--model"):
            raise gated
    with pytest.raises(KeyError):
        with hub.hub_lookup(MODEL, given_as="--model"):
            raise KeyError("a bug")
    with pytest.raises(hub_errors.LocalEntryNotFoundError):  # an existing path: nothing reworded
        with hub.hub_lookup(str(tmp_path), given_as="--model"):
            raise hub_errors.LocalEntryNotFoundError("not cached")
    with pytest.raises(ValueError, match="kind must be one of model, dataset"):
        with hub.hub_lookup(MODEL, kind="space"):
            pass
