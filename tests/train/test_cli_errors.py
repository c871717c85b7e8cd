"""angle-train and angle-eval as users meet them: a mistake in the flags, files or data is one line on stderr,
`PROG: error: MESSAGE`, with status 2 and no traceback (--debug shows it; a bug always does); --version; the
evaluation's progress bars. The CLIs run in-process (main(argv)), every mistake caught before a model loads."""

import json
import os
import re
import sys
from importlib.metadata import version

import pytest
import torch
from train_helpers import make_encoder

import angle_kernels
from angle_train import cli, evaluate, trainer
from angle_train.data import DataError, Prompts
from angle_train.export import save_pretrained

PAIRS = [("a man plays a guitar", "a man is playing the guitar"), ("the cat sleeps", "a dog runs in the park"),
         ("two kids play football", "children kick a ball"), ("a plane lands", "the chef cooks pasta"),
         ("a woman slices an onion", "someone cuts an onion"), ("heavy rain in the city", "the sun sets")]
PROGRAMS = {"angle-train": cli.main, "angle-eval": evaluate.main}


def run(program: str, argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the program's main(argv), which is expected to exit."""
    with pytest.raises(SystemExit) as exit_info:
        PROGRAMS[program](argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def write_stsb(path, pairs=PAIRS):
    """An STS Benchmark file (tab-separated, score in field 5, texts in 6 and 7)."""
    path.write_text("".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{i * 0.9:.3f}\t{a}\t{b}\n"
                            for i, (a, b) in enumerate(pairs)), encoding="utf-8")
    return path


# (flags, what the one line says): common mistakes, with the files they name written by the fixture `files`
TRAIN_MISTAKES = [
    (["--train-data", "nope.jsonl"], "--train-data nope.jsonl: no such file or folder"),
    # a refusal of the data as a whole names the flag that gave it: a folder given as data did not
    (["--train-data", "pairs.xml"], "--train-data pairs.xml: unknown file type; use .jsonl, .csv, .tsv"),
    (["--train-data", "not-sts"], "--train-data not-sts: a folder, not a Hugging Face dataset saved by save_to_disk"),
    (["--objective", "arccse", "--train-data", "not-sts"], "--train-data not-sts: a folder, not a Hugging Face "
                                                           "dataset saved by save_to_disk"),
    (["--dev-data", "not-sts"], "--dev-data not-sts: no STS.input.*.txt / STS20xx.input.*.txt files"),
    (["--dev-data", "pairs.xml"], "--dev-data pairs.xml: unknown file type"),
    (["--train-data", "wide.csv"], "wide.csv, line 3: more fields than the header's 3"),
    (["--chunk-size", "8", "--chunk-tokens", "512"], "choose at most one of --chunk-size"),
    (["--lr", "-1"], "--lr must be > 0; got -1.0"),
    (["--batch-size", "0"], "--batch-size must be >= 1; got 0"),
    (["--log-every", "0"], "--log-every must be >= 1; got 0"),  # logged every step, where 0 means off elsewhere
    # sentence-transformers' names for the pooling (their modules.json's, their Pooling's arguments) given ours
    (["--pooling", "mean"], "argument --pooling: invalid choice: 'mean'"),
    (["--pooling", "mean"], "); sentence-transformers' 'mean' pooling is 'avg' here"),  # after argparse's choices
    (["--pooling", "lasttoken"], "sentence-transformers' 'lasttoken' pooling is 'last' here"),
    (["--schedule", "Cosine"], "); did you mean cosine?"),
    (["--pooling", "Avg"], "); did you mean avg?"),  # a short name in capitals: case is not counted
    (["--Batch-Size", "8"], "unrecognized arguments: --Batch-Size 8; did you mean --batch-size?"),
    # a misspelt flag: argparse named it, and the one meant is said
    (["--bach-size", "8"], "unrecognized arguments: --bach-size 8; did you mean --batch-size?"),
    (["--lerning-rate", "0.1", "--max-lenght", "12"], "unrecognized arguments: --lerning-rate 0.1 --max-lenght 12; "
                                                      "did you mean --max-length?"),  # nothing close to --lr
    (["--config", "typo.yaml"], "--config: unknown setting 'batch_sise'; did you mean batch_size?"),
    (["--matryoshka-dims", "32;64", "--angle-w", "0"], "--matryoshka-dims: expected integers, by spaces or commas "
                                                       "(32 64, or 32,64); got '32;64'"),
    (["--mask-rates", "0.1/0.2", "0.3", "--objective", "arccse"], "--mask-rates: expected numbers, by spaces or "
                                                                   "commas (32 64, or 32,64); got '0.1/0.2'"),
    (["--matryoshka-dims", "32,", "--angle-w", "0"], "--matryoshka-dims: expected numbers, by spaces or commas "
                                                     "(32 64, or 32,64); got '32,'"),
    (["--bf16", "maybe"], "argument --bf16: expected a boolean"),
    # a list of choices by commas: "did you mean tensorboard?" before, which dropped wandb
    (["--report-to", "tensorboard,wandb"], "argument --report-to: invalid choice: 'tensorboard,wandb' (choose from "
                                           "'none', 'all', 'tensorboard', 'wandb'); several are separate values: "
                                           "--report-to tensorboard wandb"),
    (["--attention", "spda"], "argument --attention: invalid choice: 'spda' (choose from 'sdpa', 'eager', "
                              "'flash_attention_2', 'flash_attention_3', 'flex_attention'); did you mean sdpa?"),
    (["--attention", "flash_attention_2", "--bf16", "1"], "--attention flash_attention_2 runs on CUDA GPUs, and this "
                                                          "run is on cpu"),
    (["--attention", "flash_attention_3"], "--attention flash_attention_3 computes in float16 or bfloat16, and this "
                                           "run computes in float32: add --bf16 1 (or --fp16 1), or load the weights "
                                           "in 16 bits (--model-dtype bfloat16)"),
    (["--attention", "flex_attention", "--pack", "64"], "--pack 64: packed rows take sdpa or eager attention (a 4D "
                                                        "mask), and --attention is flex_attention: use --pack 0"),
    (["--config", "run.yaml"], "--config run.yaml: no such file"),
    (["--config", "broken.yaml"], "--config broken.yaml: not valid YAML"),
    (["--config", "mean.yaml"], "--config: setting 'pooling': invalid choice 'mean'"),
    (["--resume", "empty-checkpoint"], "cannot resume from empty-checkpoint"),
    (["--output-dir", "done"], "--output-dir done holds an earlier run (final/)"),
    (["--output-dir", ""], "--output-dir must name a folder"),
    # an unset shell variable after a flag: --resume "" started afresh and --dev-data "" ran without evaluation in
    # silence; --train-data "" failed inside datasets, --model "" in the Hub's id check without naming the flag
    (["--train-data", ""], "--train-data must name a file, folder or dataset; got an empty text"),
    (["--resume", ""], "--resume must name a checkpoint folder or 'auto'; got an empty text"),
    (["--dev-data", " "], "--dev-data must name a file, folder or dataset; got an empty text"),
    (["--model", ""], "--model must name a model (a Hugging Face hub name or a local folder); got an empty text"),
    # folders transformers failed on with a traceback: a LoRA run's best/ (the adapter alone), a folder of no model
    (["--model", "adapter"], "--model adapter holds a LoRA adapter without its base model"),
    (["--model", "not-sts"], "--model not-sts: not a model folder (no config.json)"),
    (["--output-dir", "pairs.xml"], "--output-dir pairs.xml is a file, not a folder"),
    (["--output-dir", "pairs.xml/run"], "--output-dir pairs.xml/run: the folder cannot be made or written"),
    # settings that apply only with another one, which is off: silently ignored before
    (["--lora-r", "8"], "--lora-r sets up LoRA adapters, which train only with --lora 1"),
    (["--text-column", "sentence"], "--text-column is a setting of --objective arccse"),
    (["--espresso-dim", "64"], "--espresso-dim is the compressed width of --espresso, which this run does not train"),
    (["--false-negative-strategy", "relative"], "--false-negative-strategy sets the threshold of the false-negative "
                                                "filter, which is off without --false-negative-margin"),
    (["--warmup", "1.5"], "--warmup 1.5: a warmup of 1 or more is a number of steps, a whole one"),
    (["--model-dtype", "float16", "--fp16", "1"], "float16 weights take float16 gradients"),
    (["--model-dtype", "bfloat16", "--fp16", "1"], "the weights are one 16-bit type and the autocast the other"),
    (["--eval-every", "5"], "--eval-every 5 evaluates on the dev data, and this run has none"),
    (["--data-format", "A"], "--data-format says how to read a file or dataset, and --train-data builtin:demo is"),
    (["--dev-data", "builtin:demo-sts", "--dev-split", "test"],
     "--dev-split says how to read a dev file or dataset, and --dev-data builtin:demo-sts is built in"),
    (["--dev-data", "builtin:demo-sts", "--dev-columns", "text1=a"], "leave out --dev-columns"),
    # a data file has no splits: the split was ignored in silence
    (["--train-data", "sts-test.csv", "--train-split", "test"],
     "--train-split test says which split of a Hugging Face dataset to read, and --train-data sts-test.csv is a data "
     "file or folder, which has no splits"),
    (["--dev-data", "sts-test.csv", "--dev-split", "test"], "--dev-split test says which split of a Hugging Face "
     "dataset to read, and --dev-data sts-test.csv is a data file or folder, which has no splits: leave out "
     "--dev-split"),
    # built-in training data, a dev file read by --dev-columns: --columns would read nothing
    (["--dev-data", "renamed-dev.csv", "--dev-columns", "text1=a", "--columns", "text1=b"], "leave out --columns"),
    # a dev file of a fixed layout (STS-B's TSV) takes no mapping: one given for it alone was ignored
    (["--dev-data", "sts-test.csv", "--dev-columns", "text1=a"], "sts-test.csv: --dev-columns maps its columns "
     "(text1=a), but it is an STS-B file, read in its fixed layout, which takes no mapping: leave out --dev-columns"),
    (["--ibn-w", "0"], "--ibn-w: format B trains the contrastive term of each query against the positives only"),
    (["--train-data", "builtin:demo-sts", "--cln-w", "2"], "--cln-w: format A has no hard negatives"),
    # the in-batch terms' options with those terms weighted 0: they changed nothing, and the start line said
    # "false negatives filtered"
    (["--train-data", "builtin:demo-sts", "--ibn-w", "0", "--false-negative-margin", "0.1", "--ibn-partition", "gte"],
     "--false-negative-margin and --ibn-partition act on the in-batch terms, which format A does not compute with "
     "--ibn-w 0: give --ibn-w a weight above 0, or leave out --false-negative-margin and --ibn-partition"),
    # a list flag without values (an empty shell variable after it): trained without them, silently, before
    (["--matryoshka-dims"], "argument --matryoshka-dims: expected at least one argument"),
    (["--lora-targets"], "argument --lora-targets: expected at least one argument"),
]
HUB_NAME = "owner/model"  # never looked up: each mistake below is found before the model loads
EVAL_MISTAKES = [
    (["./run/final", "sts-test.csv"], "MODEL ./run/final: no such folder"),
    (["run", "sts-test.csv"], "MODEL run: not a model folder (no config.json"),
    (["sts-test.csv", "run"], "MODEL comes before the datasets"),
    # angle-train's random demo models: transformers' "Repo id must use alphanumeric chars" before
    (["builtin:tiny-bert", "sts-test.csv"], "MODEL builtin:tiny-bert: angle-train's built-in models are random"),
    ([HUB_NAME, "STS16"], "PATH STS16: no such file or folder"),
    ([HUB_NAME, "not-sts"], "PATH not-sts: no STS.input.*.txt / STS20xx.input.*.txt files"),
    ([HUB_NAME, "sts-test.csv", "sts-test.csv"], "two PATHs give datasets of the same name"),
    ([HUB_NAME, "sts-test.csv", "--json", "results/sts.json"], "--json results/sts.json: no folder"),
    ([HUB_NAME, "sts-test.csv", "--batch-size", "0"], "argument --batch-size: expected a whole number >= 1; got 0"),
    ([HUB_NAME], "the following arguments are required: PATH"),
    ([HUB_NAME, "sts-test.csv", "--batchsize", "8"], "unrecognized arguments: --batchsize 8; did you mean "
                                                     "--batch-size?"),
    ([HUB_NAME, "sts-test.csv", "--pooling", "cls_token"], "sentence-transformers' 'cls_token' pooling is 'cls' here"),
    ([HUB_NAME, "sts-test.csv", "--attention", "flash_attention_3"], "--attention flash_attention_3 runs on CUDA "
                                                                      "GPUs, and this run is on cpu"),
    # a width list by another separator: "expected a whole number >= 1; got '64;32'" before
    ([HUB_NAME, "sts-test.csv", "--dims", "64;32"], "argument --dims: expected widths (whole numbers >= 1, or "
                                                    "'trained'), by spaces or commas (64 32, or 64,32); got '64;32'"),
    ([HUB_NAME, "sts-test.csv", "--dims", "64,"], "argument --dims: expected widths"),
    ([HUB_NAME, "sts-test.csv", "--dims", "64,0"], "argument --dims: expected a whole number >= 1; got 0"),
]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """The files and folders the mistakes name, in tmp_path, which becomes the working folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.xml").write_text("<pairs><pair>a b</pair></pairs>\n")
    (tmp_path / "wide.csv").write_text("text1,text2,label\na b,a c,1\nd e,f g,0,0.5\n")
    (tmp_path / "broken.yaml").write_text("lr: [1e-4\nbatch_size: 8\n")
    (tmp_path / "mean.yaml").write_text("pooling: mean\n")
    (tmp_path / "typo.yaml").write_text("batch_sise: 8\n")
    (tmp_path / "empty-checkpoint").mkdir()
    (tmp_path / "done" / "final").mkdir(parents=True)  # a finished run's output folder
    write_stsb(tmp_path / "sts-test.csv")
    (tmp_path / "renamed-dev.csv").write_text("a,text2,label\n" + "".join(f"{a},{b},{i * 0.9:.1f}\n"
                                                                        for i, (a, b) in enumerate(PAIRS)))
    (tmp_path / "run").mkdir()  # a run's OUTPUT_DIR, which holds the models in final/ and best/
    (tmp_path / "not-sts").mkdir()
    (tmp_path / "adapter").mkdir()  # a LoRA run's best/: the adapter, without its base model
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")


def assert_one_line_error(program: str, status: int, out: str, err: str, said: str) -> None:
    assert status == 2, err
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), err
    assert said in lines[0]


@pytest.mark.parametrize("flags, said", TRAIN_MISTAKES)
def test_angle_train_mistakes_are_one_line(flags, said, files, capsys):
    argv = ["--output-dir", "out", "--device", "cpu", "--progress", "0", *flags]
    assert_one_line_error("angle-train", *run("angle-train", argv, capsys), said)


@pytest.mark.parametrize("settings, said", [
    ({"schedule": "Cosine"}, "--schedule: invalid choice 'Cosine' (choose from linear, cosine, constant)"),
    ({"objective": "ArcCSE"}, "--objective: invalid choice 'ArcCSE' (choose from angle, arccse)"),
    ({"model_dtype": "fp16"}, "--model-dtype: invalid choice 'fp16'"),
    ({"report_to": ["wandb", "mlflow"]}, "--report-to: invalid choice 'mlflow'"),
    ({"report_to": "wandb,tensorboard"}, "--report-to: invalid choice 'wandb,tensorboard' (choose from none, all, "
                                         "tensorboard, wandb); several are separate values: --report-to wandb "
                                         "tensorboard"),
    ({"bf16": "maybe"}, "--bf16: expected a boolean"),
    ({"batch_size": 8.5}, "--batch-size: invalid int value: 8.5"),
    ({"seed": True}, "--seed: invalid int value: True"),
    ({"prompt": 5}, "--prompt: expected a text; got int 5"),
    ({"lora_targets": "q_proj"}, "--lora-targets sets up LoRA adapters"),  # one word, as the flag's one value
    ({"train_data": ""}, "--train-data must name a file, folder or dataset"),
])
def test_settings_given_in_python_are_checked_as_the_flags_are(settings, said):
    """TrainConfig made in Python (train()'s API) took any value: schedule="Cosine" trained the linear schedule,
    objective="ArcCSE" AnglE's objective, bf16="no" turned bf16 autocast on, model_dtype="fp16" raised a bare
    KeyError. Each setting is now taken as its flag takes its words, and refused naming the flag."""
    from angle_train.config import TrainConfig

    with pytest.raises(ValueError) as raised:
        TrainConfig(**settings).validate()
    assert said in str(raised.value)


def test_settings_given_in_python_are_converted_as_the_flags_words_are():
    from angle_train.config import TrainConfig

    cfg = TrainConfig(bf16="no", fp16=0, progress="yes", batch_size="16", lr="1e-4", report_to="tensorboard",
                      matryoshka_dims=(64, "32"), lora=True, lora_targets=("q_proj", "v_proj")).validate()
    assert (cfg.bf16, cfg.fp16, cfg.progress, cfg.batch_size, cfg.lr) == (False, False, True, 16, 1e-4)
    assert (cfg.report_to, cfg.matryoshka_dims, cfg.lora_targets) == (["tensorboard"], [64, 32], ["q_proj", "v_proj"])
    # a number list by commas, as a flag's words or one text: --matryoshka-dims 64,32 as --matryoshka-dims 64 32
    cfg = TrainConfig(matryoshka_dims="64, 32", matryoshka_weights=("1", "0.5"), angle_w=0).validate()
    assert cfg.matryoshka_dims == [64, 32]
    assert cli.config_from_args(["--matryoshka-dims", "64,32", "16", "--matryoshka-weights", "1,1,0.5",
                                 "--angle-w", "0"]).matryoshka_weights == [1.0, 1.0, 0.5]



def test_an_unknown_setting_given_in_python_names_the_closest_one():
    """TrainConfig(batch_sise=8) raised the dataclass's TypeError, naming the keyword alone; it now says what the
    --config key says, and lists every unknown keyword at once."""
    from angle_train.config import TrainConfig

    with pytest.raises(TypeError, match=r"^TrainConfig\(\) got unknown setting 'batch_sise'; did you mean "
                                        r"batch_size\?$"):
        TrainConfig(batch_sise=8)
    with pytest.raises(TypeError, match=r"^TrainConfig\(\) got unknown settings 'epochz', 'warmpu', 'colour'; "
                                        r"did you mean epochs \(for epochz\), warmup \(for warmpu\)\?$"):
        TrainConfig(epochz=2, warmpu=0.1, colour="red")
    with pytest.raises(TypeError, match=r"^TrainConfig\(\) got unknown setting 'colour'$"):
        TrainConfig(colour="red")


@pytest.mark.parametrize("argv, said", EVAL_MISTAKES)
def test_angle_eval_mistakes_are_one_line(argv, said, files, capsys):
    assert_one_line_error("angle-eval", *run("angle-eval", argv, capsys), said)


@pytest.mark.parametrize("program, argv, error, raised_in", [
    ("angle-train", ["--chunk-size", "8", "--chunk-tokens", "512"], ValueError, "config.py"),
    ("angle-eval", ["owner/model", "missing-folder"], DataError, "evaluate.py"),
])
def test_debug_shows_the_traceback(program, argv, error, raised_in, tmp_path, monkeypatch):
    """--debug lets the error propagate with its traceback, down to the check that raised it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as raised:
        PROGRAMS[program]([*argv, "--debug"])
    assert raised.traceback[-1].path.name == raised_in


@pytest.mark.parametrize("bug, error", [
    (lambda cfg: json.loads("{"), json.JSONDecodeError),  # a ValueError from outside angle_train
    (lambda cfg: Prompts(text=5), TypeError),  # a TypeError, even from angle_train's own code
])
def test_a_bug_keeps_its_traceback(bug, error, tmp_path, monkeypatch):
    """Only the errors angle_train raises for bad input are one line; these stand for bugs in the training."""
    monkeypatch.setattr(trainer, "train", bug)
    with pytest.raises(error):
        cli.main(["--output-dir", str(tmp_path), "--device", "cpu"])


@pytest.mark.parametrize("module, argv, said", [
    ("angle_train.cli", ["--config", "run.ini"], "angle-train: error: --config run.ini: use a .yaml"),
    ("angle_train.evaluate", ["owner/model", "missing.csv"], "angle-eval: error: PATH missing.csv: no such file"),
])
def test_a_mistake_is_one_line_when_the_module_runs_as_main(module, argv, said, tmp_path):
    """`python -m angle_train.cli` (torchrun's form) runs the module as __main__: an error its own code raises is the
    same one line with status 2 as from the console scripts (it was taken for a bug: a traceback, status 1)."""
    import subprocess

    (tmp_path / "run.ini").write_text("x = 1\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": repo})
    assert (done.returncode, done.stderr.splitlines()) == (2, [done.stderr.strip()])
    assert done.stderr.startswith(said)


@pytest.mark.parametrize("program", ["angle-train", "angle-eval"])
def test_version(program, capsys):
    status, out, _ = run(program, ["--version"], capsys)
    assert status == 0
    assert out.strip() == f"{program} {angle_kernels.__version__} (torch {torch.__version__}, transformers " \
                          f"{version('transformers')})"


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A random tiny BERT exported as angle-train exports, an STS-B file and a retrieval file of 6 pairs each."""
    folder = tmp_path_factory.mktemp("eval")
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    model = save_pretrained(encoder, tokenizer, str(folder / "model"), max_length=16)
    retrieval = folder / "nq-mini.jsonl"
    retrieval.write_text("".join(json.dumps({"query": a, "positive": b}) + "\n" for a, b in PAIRS))
    return [model, str(write_stsb(folder / "sts-test.csv")), str(retrieval)]


@pytest.mark.parametrize("flags, terminal, shown", [
    (["--progress", "1"], False, True), (["--progress", "0"], True, False),
    ([], False, False), ([], True, True),  # by default: when stderr is a terminal
])
def test_eval_progress_bars(flags, terminal, shown, tiny_export, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert evaluate.main([*tiny_export, *flags]) == 0
    captured = capsys.readouterr()
    assert "STS-B" in captured.out and "nq-mini: recall@1" in captured.out  # the results table, on stdout
    for name in ("STS-B", "nq-mini"):  # a bar per dataset, on stderr, counting its 12 texts
        if shown:
            assert re.search(rf"{name}: 100%.* 12/12 ", captured.err), captured.err
        else:
            assert f"{name}:" not in captured.err, captured.err
    # transformers' bar as the model loads follows --progress too: it was shown by default into a log file or a pipe
    assert ("Loading weights" in captured.err) == shown, captured.err
