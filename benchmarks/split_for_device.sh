#!/usr/bin/env bash
# Split a file into N parts of at most 40 MiB under .carry/<name>/ and print how to rejoin them.
#
# The GPU machine cannot download anything and takes at most 64 MiB of carried files per call, so a
# larger file (the ~98 MB SmolLM2 GGUF) goes over in parts, one carried path per call (`carry:
# [".carry/<name>/<name>.part00"]`, then part01, ...); the parts stay on the warm machine between calls, and
# the printed command, run there last, rebuilds the file and checks its sha256.
#
# Usage (repo root): bash benchmarks/split_for_device.sh FILE [N]    (N: default the fewest parts)
set -euo pipefail
MAX=$((40 << 20))
file=${1:?usage: $0 FILE [N]}
name=$(basename "$file")
size=$(stat -c %s "$file")
n=${2:-$(( (size + MAX - 1) / MAX ))}
if (( n < 1 || (size + n - 1) / n > MAX )); then
    echo "error: $size bytes in $n part(s) leaves parts over 40 MiB; use N >= $(( (size + MAX - 1) / MAX ))" >&2
    exit 2
fi
dir=".carry/$name"
rm -rf "$dir" && mkdir -p "$dir"
# -n N: N parts of equal size (the last one takes the remainder); -d -a 2: suffixes 00, 01, ... sort in order.
split -n "$n" -d -a 2 "$file" "$dir/$name.part"
ls -l "$dir" >&2
echo "cat $(printf '%s ' "$dir/$name".part*)> $name && echo '$(sha256sum "$file" | cut -d' ' -f1)  $name' | sha256sum -c"
