"""Config loading: YAML sections, dotted overrides, and the messages users see on mistakes."""

from pathlib import Path

import pytest

from schnet_ipu.config import Config, ConfigError, config_from_dict, load_config

CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-3\n  epochs: 3\nmodel:\n  graph: radius\n")
    cfg = load_config(path, ["optim.lr=5e-4", "data.subset=20000", "logging.plot=false"])
    assert cfg.optim.lr == 5e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.data.subset == 20000 and isinstance(cfg.data.subset, int)
    assert cfg.logging.plot is False
    assert cfg.model.graph == "radius" and cfg.optim.epochs == 3


def test_int_is_accepted_where_float_expected():
    assert load_config(None, ["model.cutoff=5"]).model.cutoff == 5.0


def test_unknown_key_names_itself_and_closest_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key optim\.lrr; did you mean optim\.lr"):
        load_config(None, ["optim.lrr=1e-3"])
    with pytest.raises(
        ConfigError, match=r"unknown config key model\.hiden_channels.*hidden_channels"
    ):
        load_config(write(tmp_path, "model:\n  hiden_channels: 64\n"))
    with pytest.raises(ConfigError, match=r"unknown config key optimiser; did you mean optim"):
        load_config(None, ["optimiser.lr=1"])


def test_wrong_type_names_key_expected_type_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr expects float, got 'fast' \(str\)"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"data\.subset expects int, got 2\.5 \(float\)"):
        load_config(write(tmp_path, "data:\n  subset: 2.5\n"))
    with pytest.raises(ConfigError, match=r"logging\.plot expects bool, got 3 \(int\)"):
        load_config(None, ["logging.plot=3"])
    with pytest.raises(ConfigError, match=r"data\.water_sizes expects a list of int"):
        load_config(None, ["data.water_sizes=7"])


def test_bad_choice_suggests_the_closest():
    with pytest.raises(
        ConfigError, match=r"model\.graph = 'knnn' is not one of knn, radius; did you mean 'knn'"
    ):
        load_config(None, ["model.graph=knnn"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["backend.replicas=0"], r"backend\.replicas must be > 0"),
        (["data.val=0.6", "data.test=0.5"], r"leaves no training data"),
        (["packing.algorithm=tuple", "model.graph=knn"], r"set model\.graph=radius"),
        (
            ["model.graph=knn", "packing.algorithm=lpfhp", "model.k=40", "packing.max_nodes=32"],
            r"lower model\.k or raise packing\.max_nodes",
        ),
        (["packing.max_edges=301", "model.graph=radius"], r"must be even"),
        (["data.water_sizes=[5, 3]"], r"min <= max"),
        (["backend.device=cpu", "backend.cuda_graphs=true"], r"cuda_graphs=true needs CUDA"),
        (["backend.precision=fp16"], r"backend\.precision = 'fp16' is not one of"),
        (["optim.adam_beta2=1.0"], r"optim\.adam_beta2 must be in \(0, 1\)"),
    ],
)
def test_impossible_combinations_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_true_and_false_choices_read_from_yaml_booleans():
    assert load_config(None, ["backend.cuda_graphs=false"]).backend.cuda_graphs == "false"
    assert load_config(None, ["backend.cuda_graphs=true"]).backend.cuda_graphs == "true"


def test_override_syntax_and_sections():
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, ["optim=3"])


def test_round_trip_through_dict():
    cfg = load_config(None, ["optim.lr=2e-4", "model.graph=radius"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_removed_keys_name_their_replacement(tmp_path):
    with pytest.raises(ConfigError, match=r"logging\.wandb was removed: set logging\.wandb_mode"):
        load_config(None, ["logging.wandb=true"])
    with pytest.raises(ConfigError, match=r"loader\.cache was removed"):
        load_config(write(tmp_path, "loader:\n  cache: false\n"))


@pytest.mark.parametrize(
    ("wandb", "mode", "now"), [(False, "online", "disabled"), (True, "online", "online")]
)
def test_a_stored_config_with_removed_keys_still_loads(wandb, mode, now):
    """Checkpoints and run folders written before the removal: logging.wandb=false meant no
    wandb whatever wandb_mode said; loader.cache had no effect."""
    stored = Config().to_dict()
    stored["logging"].update(wandb=wandb, wandb_mode=mode)
    stored["loader"]["cache"] = False
    cfg = config_from_dict(stored)
    assert cfg.logging.wandb_mode == now
    assert cfg.loader == Config().loader


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    assert isinstance(load_config(path), Config)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "optim: [1, 2\n"))


def test_print_config_into_a_reader_that_stops_early_ends_quietly():
    """``train.py --print-config | head -1``: the first line, and no traceback."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    piped = subprocess.run(
        f"{sys.executable} train.py --config configs/qm9.yaml --print-config | head -1",
        shell=True, cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert piped.stdout.startswith("# recipe energies") and piped.stdout.count("\n") == 1
    assert piped.stderr == ""
