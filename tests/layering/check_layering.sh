#!/bin/bash
# Checks gdr's layering on the include graph of its headers:
#
#   1. nothing in gdr/sched/ includes gdr/coro/: coroutines are built on the
#      scheduler, not the other way round;
#   2. memory's types (space, access, view, remote_view, registration) include
#      neither gdr/cuda/ nor a CUDA header: they describe memory and compile
#      without CUDA; the CUDA-backed operations (copy, resource, buffer) sit
#      above gdr/cuda/ and may include it.
#
#   bash tests/layering/check_layering.sh [ROOT]    # ROOT holds gdr/; default .
#
# Includes are followed transitively through gdr's own headers, and an
# include counts wherever it stands, inside `#if GDR_HAS_CUDA` too: a rule
# must hold with every feature enabled. Prints each violation as its include
# chain and exits 1 if there is one; exits 2 if the tree does not look like
# gdr (a rule that matches no header would pass vacuously).
set -uo pipefail

root=${1:-.}
[[ -d $root/gdr ]] || { echo "check_layering: no gdr/ under '$root'" >&2; exit 2; }

# Rules: which headers (an extended regex on the path below ROOT) may not
# reach which includes (an extended regex on the included name), and why.
rules=(
  'gdr/sched/[^/]+\.hpp$' '^gdr/coro/'
  "sched/ must not include coro/ (coro is built on sched)"
  'gdr/memory/(space|access|view|remote_view|registration)\.hpp$' '^gdr/cuda/|^cuda[a-z_]*\.h$|^cuda/'
  "memory's types must not include cuda/ (only its CUDA-backed operations may)"
)

# The gdr headers and system headers that `$1` (a path below ROOT) includes,
# one per line, as written between the brackets or quotes.
includes_of() {
  sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]+)[>"].*/\1/p' "$root/$1"
}

declare -A parent  # reached include -> the header that included it (BFS tree)

# reach HEADER FORBIDDEN: fills `parent` with everything HEADER includes,
# transitively through gdr/ headers that exist under ROOT. System headers are
# leaves, and so are includes matching FORBIDDEN: what they include would
# only repeat the violation.
reach() {
  local start=$1 forbidden=$2 h inc
  local -a queue=("$start")
  parent=(["$start"]="")
  while ((${#queue[@]})); do
    h=${queue[0]}
    queue=("${queue[@]:1}")
    [[ $h == gdr/* && -f $root/$h ]] || continue
    [[ $h != "$start" && $h =~ $forbidden ]] && continue
    while IFS= read -r inc; do
      [[ -v parent[$inc] ]] && continue
      parent[$inc]=$h
      queue+=("$inc")
    done < <(includes_of "$h")
  done
}

# chain INCLUDE: "a -> b -> INCLUDE", from the header reach() started at.
chain() {
  local n=$1 out=$1
  while [[ -n ${parent[$n]} ]]; do
    n=${parent[$n]}
    out="$n -> $out"
  done
  echo "$out"
}

mapfile -t headers < <(cd "$root" && find gdr -name '*.hpp' | LC_ALL=C sort)
((${#headers[@]})) || { echo "check_layering: no headers under $root/gdr" >&2; exit 2; }

violations=0
for ((r = 0; r < ${#rules[@]}; r += 3)); do
  from=${rules[r]} forbidden=${rules[r + 1]} why=${rules[r + 2]}
  matched=0
  for h in "${headers[@]}"; do
    [[ $h =~ $from ]] || continue
    matched=$((matched + 1))
    reach "$h" "$forbidden"
    while IFS= read -r inc; do
      [[ -n $inc && $inc =~ $forbidden ]] || continue
      echo "layering violation: $why"
      echo "  $(chain "$inc")"
      violations=$((violations + 1))
    done < <(printf '%s\n' "${!parent[@]}" | LC_ALL=C sort)
  done
  if ((matched == 0)); then
    echo "check_layering: no header matches '$from' (renamed? update the rule)" >&2
    exit 2
  fi
  echo "checked $matched header(s) matching $from against $forbidden"
done

if ((violations)); then
  echo "$violations layering violation(s)"
  exit 1
fi
echo "layering ok"
