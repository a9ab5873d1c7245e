#!/usr/bin/env bash
# Nsight Compute profiles of the decode kernels (device machine, after `. bench/device_setup.sh`):
# the details page and the per-instruction SASS page (warp-stall samples) of one launch per format.
# Usage: bash bench/profile_gpu.sh OUTDIR [format ...]   (default: bf16 fp8 turboquant_4bit_nc)
# PROFILE_ARGS adds bench/profile_decode.py options (e.g. "--context 131072"); PROFILE_TAG suffixes the file names.
set -u
out=$1; shift
formats=("$@"); [ ${#formats[@]} -eq 0 ] && formats=(bf16 fp8 turboquant_4bit_nc)
for fmt in "${formats[@]}"; do
  f=$fmt${PROFILE_TAG:-}
  ncu --clock-control none -k "regex:_decode_attention_kernel|_tq_decode_kernel|_tq_gluon_kernel|_decode_gluon_kernel|_tq_warp_kernel" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters ${NCU_SECTIONS:-} \
      --export "$out/ncu_$f" --force-overwrite python3 bench/profile_decode.py --format "$fmt" ${PROFILE_ARGS:-} > "/tmp/ncu_$f.log" 2>&1
  ncu --import "$out/ncu_$f.ncu-rep" --page details > "$out/ncu_$f.txt" 2>&1
  ncu --import "$out/ncu_$f.ncu-rep" --page source --print-source sass --csv > "$out/ncu_${f}_sass.csv" 2>&1
  rm -f "$out/ncu_$f.ncu-rep"
  tail -3 "/tmp/ncu_$f.log"; grep -E "Duration|Achieved Occupancy|Issued Ipc|No Eligible|Registers Per|Memory Throughput" "$out/ncu_$f.txt" | head -12
done
