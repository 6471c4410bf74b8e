#!/bin/bash
# Checks gdr's layering on the include graph of its headers:
#
#   1. nothing in gdr/sched/ includes gdr/coro/: coroutines are built on the
#      scheduler, not the other way round;
#   2. memory's types (space, access, view, remote_view, registration) include
#      neither gdr/cuda/ nor a CUDA header: they describe memory and compile
#      without CUDA; the CUDA-backed operations (copy, resource, buffer) sit
#      above gdr/cuda/ and may include it;
#   3. the folders form a stack, and every include points down it (or stays
#      in its folder): gdr/*.hpp (config, error) < sched < coro < cuda, verbs
#      < memory < transfer < protocol < transport < bootstrap, with
#      gdr/gdr.hpp, the umbrella, above all. transport/'s own folders
#      (loopback, tcp, verbs) sit on its files' level and may include each
#      other only without a cycle. A new folder must be given its place here.
#   4. no header is longer than 800 lines: every unit that includes gdr.hpp
#      parses them all, and a header that long holds more than one concern
#      (split it by concern, as gdr/protocol/engine/ and gdr/transport/tcp/
#      are).
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

# Rule 3: the folder stack. Helpers set globals instead of printing, so
# that the loop over every include runs no subshell.
declare -A rank=([.]=0 [sched]=1 [coro]=2 [cuda]=3 [memory]=4 [transfer]=5 [protocol]=6
  [transport]=7 [bootstrap]=8)
# folder_of HEADER: sets `folder` to its folder below gdr/ ("." for
# gdr/*.hpp, "transport/tcp" for a transport folder's header).
folder_of() {
  local p=${1#gdr/}
  case $p in
    */*/*) p=${p%/*}; [[ $p == transport/* ]] || p=${p%%/*} ;;
    */*) p=${p%%/*} ;;
    *) p=. ;;
  esac
  folder=$p
}
# rank_of FOLDER: sets `frank` to its rank (transport/X: transport's), or "".
rank_of() {
  local f=${1%%/*}
  [[ $1 == . ]] && f=.
  frank=${rank[$f]-}
}
sub_edges=()
folders_checked=0
for h in "${headers[@]}"; do
  [[ $h == gdr/gdr.hpp ]] && continue  # the umbrella includes everything
  folder_of "$h"; from=$folder
  rank_of "$from"; rf=$frank
  if [[ -z $rf ]]; then
    echo "layering violation: folder '$from' has no place in the stack (rule 3 in $0)"
    violations=$((violations + 1))
    continue
  fi
  folders_checked=$((folders_checked + 1))
  while IFS= read -r inc; do
    [[ $inc == gdr/* ]] || continue
    folder_of "$inc"; to=$folder
    [[ $to == "$from" ]] && continue
    if [[ $from == transport* && $to == transport* ]]; then
      # Inside transport/: its folders may include each other (no cycle,
      # checked below); a folder's header never includes transport/'s own
      # files (the umbrellas that include the folders).
      if [[ $to == transport ]]; then
        echo "layering violation: $h includes $inc (a transport folder includes transport/'s umbrella)"
        violations=$((violations + 1))
      elif [[ $from != transport ]]; then
        sub_edges+=("$from $to")
      fi
      continue
    fi
    rank_of "$to"; rt=$frank
    if [[ -z $rt ]] || ((rt >= rf)); then
      echo "layering violation: $h includes $inc ($from may include only folders below it)"
      violations=$((violations + 1))
    fi
  done < <(includes_of "$h")
done
if ((${#sub_edges[@]})) && ! printf '%s\n' "${sub_edges[@]}" | tsort >/dev/null 2>&1; then
  echo "layering violation: transport/'s folders include each other in a cycle:"
  printf '  %s\n' "${sub_edges[@]}" | sort -u
  violations=$((violations + 1))
fi
echo "checked $folders_checked header(s) against the folder stack"

# Rule 4: the size of a header.
max_lines=800
for h in "${headers[@]}"; do
  n=$(wc -l <"$root/$h")
  if ((n > max_lines)); then
    echo "layering violation: $h has $n lines (at most $max_lines; split it by concern)"
    violations=$((violations + 1))
  fi
done
echo "checked ${#headers[@]} header(s) against $max_lines lines"

if ((violations)); then
  echo "$violations layering violation(s)"
  exit 1
fi
echo "layering ok"
