#!/usr/bin/env bash
# Assemble the model on the GPU machine from the parts earlier calls copied to $STAGE
# (/root/stage) and the part this call carries in .stage/, if any:
#   bash tools/device_model.sh MODEL_PATH
# The parts are pieces of the GGUF file itself (`split -b 32M model .stage/part.`: three calls
# beside a 16+ MiB working tree) or of its xz stream (`xz -9e -T2 -c model > m.xz; split -b 45M
# m.xz .stage/part.`: SmolLM2 Q4_1's 98 MB become 90 MB, two calls); an xz stream is unpacked
# with Python's lzma (no xz binary needed). Does nothing when MODEL_PATH exists.
set -uo pipefail
model=$1
stage=${STAGE:-/root/stage}
[ -f "$model" ] && exit 0
mkdir -p "$stage"
cp .stage/part.* "$stage"/ 2>/dev/null  # the part this call carries, if any
joined="$stage/joined.part"
cat "$stage"/part.* > "$joined" || exit 1
if [ "$(head -c 6 "$joined" | od -An -tx1 | tr -d ' \n')" = "fd377a585a00" ]; then
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 24)' \
    "$joined" "$model.tmp" && mv "$model.tmp" "$model" || exit 1
  rm -f "$joined"
else
  mv "$joined" "$model"
fi
