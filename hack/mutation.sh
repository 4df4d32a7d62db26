#!/usr/bin/env bash
# Mutation testing of recipes/ with cosmic-ray (`make mutation`; not part of `make test`).
#
# Works on a copy of the tree in a temporary directory (never mutates the shared working tree):
# the copy's recipes/ is imported as rljob.recipes through a build/pkgview link on PYTHONPATH, which
# wins over the editable install. Each mutant runs the recipe-core tests (goldens, plan tables, CLI),
# stopping at the first failure. Prints cosmic-ray's report and the kill rate.
#
#   make mutation                                           # every module of recipes/ (hours on 2 cores)
#   MUTATION_MODULES="recipes/mesh.py recipes/naming.py" make mutation
#   MUTATION_TESTS="tests/recipes/test_mesh.py" MUTATION_MODULES=recipes/mesh.py make mutation
#   MUTATION_SAMPLE=150 MUTATION_SEED=0 make mutation         # a seeded random sample of the mutants
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.venv
MODULES=${MUTATION_MODULES:-$(cd "$ROOT" && ls recipes/*.py | grep -v __init__ | tr '\n' ' ')}
TESTS=${MUTATION_TESTS:-tests/recipes tests/cli/test_rljob_cli.py}
KEEP=${MUTATION_KEEP:-}
W=$(mktemp -d /tmp/rljob-mutation.XXXXXX)
trap '[ -n "$KEEP" ] || rm -rf "$W"' EXIT

mkdir -p "$W/tests" "$W/build/pkgview/rljob" "$W/hack"
cp -r "$ROOT/recipes" "$ROOT/examples" "$ROOT/pyproject.toml" "$W/"
cp -r "$ROOT/tests/recipes" "$ROOT/tests/cli" "$ROOT/tests/fixtures" "$W/tests/"
cp "$ROOT/hack/versions.env" "$ROOT/hack/gen_maxtext_keys.py" "$ROOT/hack/extract_jobset_schema.py" "$W/hack/"
# A conftest without the cluster/GCS plugins: the recipe tests need neither.
cat > "$W/tests/conftest.py" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
PY
ln -s ../../../recipes "$W/build/pkgview/rljob/recipes"
find "$W" -name __pycache__ -prune -exec rm -rf {} +

MODULE_LIST=$(printf '"%s", ' $MODULES)
cat > "$W/cosmic-ray.toml" <<TOML
[cosmic-ray]
module-path = [${MODULE_LIST%, }]
timeout = 120.0
excluded-modules = []
test-command = "env PYTHONSAFEPATH=1 PYTHONPATH=$W/build/pkgview $VENV/bin/pytest -x -q -p no:cacheprovider -p no:hypothesispytest -k 'not committed_list and not committed_schema' --ignore=tests/recipes/test_properties.py $TESTS"

[cosmic-ray.distributor]
name = "local"

# "X | None" only appears in annotations (strings under "from __future__ import annotations") and
# isinstance unions: every BitOr mutant there is equivalent or a TypeError, so they are not run.
[cosmic-ray.filters.operators-filter]
exclude-operators = ["core/ReplaceBinaryOperator_BitOr_.*"]
TOML

cd "$W"
echo "mutation: modules: $MODULES" >&2
echo "mutation: tests: $TESTS" >&2
# The unmutated tree must pass first.
env PYTHONSAFEPATH=1 PYTHONPATH="$W/build/pkgview" "$VENV/bin/pytest" -x -q -p no:cacheprovider \
  -k 'not committed_list and not committed_schema' --ignore=tests/recipes/test_properties.py $TESTS >/dev/null
"$VENV/bin/cosmic-ray" init cosmic-ray.toml session.sqlite
"$VENV/bin/cr-filter-operators" session.sqlite cosmic-ray.toml
if [ -n "${MUTATION_SAMPLE:-}" ]; then
  # A seeded random sample of the mutants still to run (the kill rate of a sample of n estimates the
  # whole with a standard error of about sqrt(p(1-p)/n): ~2.5 points at n=150, p=0.9). Each mutant is
  # ranked by a hash of the seed and what it is (module, operator, occurrence), not by cosmic-ray's job
  # id (a random UUID per `init`): the same seed on the same code picks the same mutants every time.
  "$VENV/bin/python" - "$MUTATION_SAMPLE" "${MUTATION_SEED:-0}" <<'PY'
import hashlib, sqlite3, sys
n, seed = int(sys.argv[1]), int(sys.argv[2])
db = sqlite3.connect("session.sqlite")
rows = db.execute(
    "select job_id, module_path, operator_name, operator_args, occurrence from mutation_specs "
    "where job_id not in (select job_id from work_results)").fetchall()
def rank(r):
    return hashlib.sha256("\0".join(map(str, (seed, *r[1:]))).encode()).hexdigest()
keep = {r[0] for r in sorted(rows, key=rank)[:n]}
todo = [r[0] for r in rows]
drop = [(j,) for j in todo if j not in keep]
db.executemany("delete from mutation_specs where job_id = ?", drop)
db.executemany("delete from work_items where job_id = ?", drop)
db.commit()
print(f"mutation: sampled {len(keep)} of {len(todo)} mutants (seed {seed})", file=sys.stderr)
PY
fi
"$VENV/bin/cosmic-ray" exec cosmic-ray.toml session.sqlite
"$VENV/bin/cr-report" session.sqlite | tail -n 40
# The kill rate over the mutants that ran (cr-rate counts the filtered, never-run ones as not surviving).
"$VENV/bin/python" - "$MODULES" "${MUTATION_SAMPLE:-all}" "${MUTATION_SEED:-0}" <<'PY'
import json, sqlite3, sys
db = sqlite3.connect("session.sqlite")
n = dict(db.execute("select test_outcome, count(*) from work_results where test_outcome is not null group by 1"))
killed = n.get("KILLED", 0) + n.get("INCOMPETENT", 0)
ran = killed + n.get("SURVIVED", 0)
print(json.dumps({"bench": "mutation", "metric": "kill_rate_percent", "value": round(100 * killed / max(ran, 1), 2),
                  "killed": killed, "survived": n.get("SURVIVED", 0), "ran": ran, "modules": sys.argv[1],
                  "tool": "cosmic-ray", "sample": sys.argv[2], "seed": int(sys.argv[3])}))
PY
