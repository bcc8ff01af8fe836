#!/bin/busybox sh
# The guest's first process (the initramfs's /init): loads the modules that reach the host's
# root, puts a writable tmpfs over it, runs the run directory's command there and powers off.
# Its own messages go to the console; the command's output to the run directory (vm.go).
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do
	insmod "/modules/$m" || echo "vm: insmod $m failed"
done
fail() {
	echo "vm: $*"
	poweroff -f
}
opts=trans=virtio,version=9p2000.L,msize=262144
mkdir -p /lower /rw /modules-guest /newroot
mount -t 9p -o "$opts,ro,cache=loose" hostroot /lower || fail "mount the host's root"
mount -t 9p -o "$opts,ro" modules /modules-guest || fail "mount the kernel's modules"
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
R=/newroot
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work $R || fail "mount the overlay"
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs shm $R/dev/shm
mount -t bpf bpf $R/sys/fs/bpf
mount -t cgroup2 cgroup2 $R/sys/fs/cgroup
# /run starts empty, as on a booted machine; /tmp is the host's, under the overlay.
mount -t tmpfs run $R/run
mkdir -p $R/run/vm
mount -t 9p -o "$opts" run $R/run/vm || fail "mount the run directory"
mkdir -p "$R/lib/modules/$(uname -r)"
mount --bind /modules-guest "$R/lib/modules/$(uname -r)"
# The kernel asks for modules (veth, sch_ingress, nf_tables, ...) with the initramfs's root as
# /: the host's modprobe, in the guest's root, answers.
printf '#!/bin/busybox sh\nexec chroot %s /sbin/modprobe "$@"\n' $R >/bin/modprobe-guest
chmod 0755 /bin/modprobe-guest
echo /bin/modprobe-guest >/proc/sys/kernel/modprobe
ip link set lo up 2>/dev/null
echo started >$R/run/vm/started
chroot $R /bin/sh /run/vm/cmd >$R/run/vm/output 2>&1
echo $? >$R/run/vm/rc.tmp && mv $R/run/vm/rc.tmp $R/run/vm/rc
sync
poweroff -f
