# Run at the end of a GPU command (from the project root), in place of `.device/save-cache.sh`:
# packs the compiled-kernel caches (FlashInfer, tvm-ffi, torch extensions, Triton) into
# $OUT/jitcache.part-aa, -ab, ...: one archive had outgrown the 16 MiB a returned file may have,
# so cold machines compiled FlashInfer's modules again (~1 min). Back here, replace the old parts
# in .device/ with the returned ones (and drop .device/jitcache.tgz); device_env.sh restores them.
cd ~ && dirs=$(ls -d .cache/flashinfer .cache/tvm-ffi .cache/torch_extensions .triton 2>/dev/null)
[ -n "$dirs" ] && tar czf - $dirs | split -b 15M - "$OUT/jitcache.part-" && ls -la "$OUT"/jitcache.part-*
cd - >/dev/null
true
