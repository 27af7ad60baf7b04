"""hetpipe-train's language-model job: the gpt model on the generated hetpipe_addition, end to end."""
import json
import re

from tests.helpers.cli import hetpipe_train


def test_gpt_on_addition_reports_exact_match_and_prints_greedy_answers(tmp_path):
    run = hetpipe_train(tmp_path, "--model=gpt", "--dataset=hetpipe_addition", "--epochs=1", "--steps_per_epoch=6",
                        "--devices=cpu,cpu")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert 0.0 <= summary["test_exact_match"] <= 1.0 and "test_accuracy" not in summary
    answers = run.stdout.split("held-out sums, answered by greedy decoding:\n")[1].splitlines()[:8]
    assert all(re.fullmatch(r"  \d{3}\+\d{3}=\d{4} \((right|wrong, \d{4} expected)\)", line) for line in answers), answers
