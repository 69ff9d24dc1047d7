"""The `dflash2-hf` command line."""

import json

from conftest import PUBLISHED, REFERENCE

from dflash2_hf.cli import main


def test_info_describes_a_dflash2_folder(capsys):
    assert main(["info", str(REFERENCE / "dflash2")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "DFlash 2" and info["class"] == "DFlash2DraftModel"
    assert info["selector_parameters"] == 8 * 64 + 2 * 96 * 8
    assert info["block_size"] == 8


def test_info_reads_a_published_config_without_weights(capsys, tmp_path):
    (tmp_path / "config.json").write_text((PUBLISHED / "muse-glimmer-30b-dflash2.config.json").read_text())
    assert main(["info", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selector_parameters"] == 256 * 6656 + 2 * 202048 * 256  # 105M: the published selector's real size
