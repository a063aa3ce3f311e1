"""GAMP-RIE and gradient descent on data from the attention-indexed model (AIM.md §6), and the
`smi aim` command line."""
import json

import numpy as np
import pytest

from smi_core.aim import aim_data, aim_gamp, aim_gd, aim_state_evolution
from smi_core.cli import main


def _gamp_gap(channel, alpha, d, seeds, max_iter=60):
    se = aim_state_evolution(channel, 2, 0.5, alpha).mmse[0]
    errs = [aim_gamp(aim_data(d, alpha, 0.5, 2, channel, seed=s), max_iter=max_iter).mmse[-1]
            for s in range(seeds)]
    return abs(np.mean(errs) - se)


@pytest.mark.parametrize("channel,alpha", [("softmax", 0.1), ("hardmax", 0.5)])
def test_gamp_follows_state_evolution_small(channel, alpha):
    assert _gamp_gap(channel, alpha, 60, 2, max_iter=20) < 0.06


@pytest.mark.slow
@pytest.mark.parametrize("channel,alpha", [("softmax", 0.08), ("softmax", 0.15), ("hardmax", 0.3), ("hardmax", 0.8)])
def test_gamp_follows_state_evolution_d100(channel, alpha):
    assert _gamp_gap(channel, alpha, 100, 8) < 0.05


def test_gd_students_learn_and_average_helps():
    data = aim_data(30, 0.3, 0.5, 2, "softmax", seed=0)
    r = aim_gd(data, students=3, steps=300, lr=0.02, seed=1)
    assert r.errors.max() < 0.5          # no data: error 1
    assert r.average_error < r.errors.mean()
    with pytest.raises(ValueError, match="hardmax"):
        aim_gd(aim_data(10, 0.1, 0.5, 2, "hardmax", seed=0))


def test_cli_se_json_csv_plot(tmp_path, capsys):
    csv, png = tmp_path / "se.csv", tmp_path / "se.png"
    rc = main(["aim", "se", "--rho", "0.5", "--tokens", "2,3", "--alphas", "0.05,0.3", "--json", "--quiet",
               "--csv", str(csv), "--plot", str(png)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and png.stat().st_size > 0 and len(csv.read_text().splitlines()) == 5
    assert out["curves"][0]["alpha_pr"] == pytest.approx(0.75 / 4)
    assert out["curves"][0]["mmse"][1] == 0


def test_cli_bad_input_exits_2(capsys):
    assert main(["aim", "se", "--rho", "0", "--quiet"]) == 2
    assert "rho" in capsys.readouterr().err
