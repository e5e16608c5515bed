#!/bin/sh
# The VM generation ID: a busybox image on Debian's generic kernel, whose CONFIG_VMGENID driver
# binds to the VMM's VMGENCTR device, which the snapshot records. Each forked child gets a new
# generation ID and the Generic Event Device's interrupt, so its kernel reseeds its RNG on its own.
# Usage: vmgenid.sh TINE IMAGE WORKDIR
set -u
T=$1 IMG=$2 W=$3
mkdir -p "$W"
export TINE_DATA_DIR=$W/data
ok() { echo "CHECK $1 ok"; }
fail() { echo "CHECK $1 FAIL $2"; }
sock() { echo "$TINE_DATA_DIR/vms/$1/vsock.sock"; }
# The Generic Event Device's interrupts a guest took (its "ACPI:Ged" line in /proc/interrupts,
# summed over CPUs), or "none" without such a line.
ged_irqs() {
  "$T" exec --socket "$(sock "$1")" -- cat /proc/interrupts 2>&1 |
    awk '/ACPI:Ged/ {s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i; n = s} END {print (n == "" ? "none" : n)}'
}
reseeded="crng reseeded due to virtual machine fork"

# The parent boots in a VMM worker confined as a child's is: while it boots, some worker
# runs as a user of its own with no capabilities, no new privileges and a seccomp filter.
"$T" snapshot --image "$IMG" --tag gen 2>"$W/snap.err" &
snap=$!
seen=""
while [ -z "$seen" ] && kill -0 $snap 2>/dev/null; do
  for st in /proc/[0-9]*/status; do
    grep -q '^Name:.*tine' "$st" 2>/dev/null || continue
    grep -q -- '__vmm-worker' "${st%status}cmdline" 2>/dev/null || continue
    uid=$(awk '/^Uid:/ {print $2}' "$st" 2>/dev/null)
    [ -n "$uid" ] && [ "$uid" != 0 ] || continue
    seen="uid $uid $(grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' "$st" | tr -s '\t\n' '  ')"
  done
  sleep 0.1
done
if wait $snap; then ok snapshot
else fail snapshot "$(tail -5 "$W/snap.err")"; exit 1; fi
# The driver's binding (its evaluation of ADDR) is in the snapshot's record, so each child's
# restore raises the GED's interrupt.
hdr=$(find "$TINE_DATA_DIR" -name snapshot.json | head -1)
grep -q '"vmgenid_driver": true' "$hdr" 2>/dev/null && ok driver-binding-recorded ||
  fail driver-binding-recorded "${hdr:-no snapshot.json}: $(grep vmgenid "$hdr" 2>/dev/null | tr -d '\n')"
echo "parent VMM while it booted: $seen"
case "$seen" in
  *"CapEff: 0000000000000000 CapBnd: 0000000000000000 NoNewPrivs: 1 Seccomp: 2"*) ok parent-vmm-confined ;;
  *) fail parent-vmm-confined "no confined worker seen while the parent booted (${seen:-none})" ;;
esac

"$T" fork --tag gen -n 3 --ready-timeout-secs 300 >"$W/fork" 2>&1
cat "$W/fork"
ids=$(grep 'ready in' "$W/fork" | awk '{print $1}')
n=$(echo "$ids" | grep -c .)
[ "$n" = 3 ] && ok fork-3 || fail fork-3 "$n of 3 ready"

good=0 bound=0 raised=0 geds=""
for id in $ids; do
  "$T" exec --socket "$(sock "$id")" -- dmesg >"$W/dmesg-$id" 2>&1
  grep -i -e vmgenid -e "$reseeded" -e ACPI0013 "$W/dmesg-$id" | sed "s/^/$id: /"
  [ "$(grep -c "$reseeded" "$W/dmesg-$id")" = 1 ] && good=$((good + 1))
  # The driver bound to the device the DSDT announces.
  "$T" exec --socket "$(sock "$id")" -- ls /sys/bus/acpi/drivers/vmgenid/ >"$W/drv-$id" 2>&1
  grep -q VMGENCTR "$W/drv-$id" && bound=$((bound + 1))
  # Its restore raised the generation ID's interrupt (the record said a driver bound).
  g=$(ged_irqs "$id"); geds="$geds $g"
  [ "$g" != none ] && [ "$g" -ge 1 ] && raised=$((raised + 1))
done
[ "$raised" = 3 ] && ok ged-interrupt-raised || fail ged-interrupt-raised "GED interrupts per child:$geds"
[ "$bound" = 3 ] && ok vmgenid-driver-bound || fail vmgenid-driver-bound "$bound of 3: $(cat "$W/drv-$(echo "$ids" | head -1)")"
[ "$good" = 3 ] && ok kernel-reseeded-on-fork || fail kernel-reseeded-on-fork "$good of 3 children logged \"$reseeded\" once"

"$T" kill --all >/dev/null 2>&1 || true
