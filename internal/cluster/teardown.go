package cluster

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A pod's processes are not the test's children: containerd's shims reparent themselves and
// the containers live in cgroups below the kubelet's cgroup root, so ending the components
// ends none of them. Teardown finds them by what they share with the node (its network or
// mount namespace, or a cgroup below its root) and kills them by PID, then removes the cgroups.

// holder keeps namespaces alive by open files on them. The kernel hands a freed namespace's
// inode number to the next namespace made (another test's, a moment later), so a number names
// one namespace only while the namespace is held: then a process whose /proc/PID/ns/KIND reads
// a held link is in that namespace, not in a later one.
type holder struct {
	files []*os.File
	links []string // "net:[INODE]", "mnt:[INODE]"
}

// hold opens the namespace file path (/run/netns/NAME, /proc/PID/ns/mnt) of a kind (net, mnt).
func (h *holder) hold(path, kind string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return fmt.Errorf("stat %s: %w", path, err)
	}
	h.files = append(h.files, f)
	h.links = append(h.links, fmt.Sprintf("%s:[%d]", kind, st.Ino))
	return nil
}

// release closes the files: the namespaces may go.
func (h *holder) release() {
	for _, f := range h.files {
		f.Close()
	}
	h.files, h.links = nil, nil
}

// in is the held namespace the process /proc/PID (dir) is in, empty when none.
func (h *holder) in(dir string) string {
	for _, kind := range []string{"net", "mnt"} {
		if l, _ := os.Readlink(dir + "/ns/" + kind); l != "" && slices.Contains(h.links, l) {
			return l
		}
	}
	return ""
}

// processes are the processes, other than this one and skip, in a held namespace or in a
// cgroup at or below root.
func (h *holder) processes(root string, skip int) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == skip || pid == os.Getpid() {
			continue
		}
		dir := "/proc/" + e.Name()
		if h.in(dir) != "" || inCgroup(dir+"/cgroup", root) {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// inCgroup reports whether a /proc/PID/cgroup file names a cgroup at or below root in any
// hierarchy.
func inCgroup(file, root string) bool {
	b, err := os.ReadFile(file)
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (parts[2] == root || strings.HasPrefix(parts[2], root+"/")) {
			return true
		}
	}
	return false
}

// killAll kills the processes list finds, by PID, until it finds none.
func killAll(list func() ([]int, error)) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		pids, err := list()
		if err != nil || len(pids) == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes survive SIGKILL: %v", pids)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// killLeftovers kills the processes in the node's network or mount namespace or below its
// cgroup root (but the mount namespace's holder) until none is left, then removes the cgroups.
func (n *Node) killLeftovers() error {
	var h holder
	defer h.release()
	if err := h.hold(netnsPath(n.Netns), "net"); err != nil {
		return err
	}
	skip := 0
	if n.mnt != nil {
		skip = n.mnt.holder.Pid()
		if err := h.hold(n.mnt.path(), "mnt"); err != nil {
			return err
		}
	}
	if err := killAll(func() ([]int, error) { return h.processes(n.CgroupRoot, skip) }); err != nil {
		return fmt.Errorf("%s's processes: %w", n.Name, err)
	}
	return removeCgroups(n.CgroupRoot)
}

// cgroupDirs are the directories of root in every cgroup hierarchy mounted under
// /sys/fs/cgroup (v1 controllers, the named systemd one, the unified v2 one).
func cgroupDirs(root string) []string {
	var dirs []string
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	for _, e := range entries {
		if e.Type()&fs.ModeSymlink != 0 || !e.IsDir() {
			continue
		}
		d := filepath.Join("/sys/fs/cgroup", e.Name(), root)
		if _, err := os.Stat(d); err == nil {
			dirs = append(dirs, d)
		}
	}
	if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", root)); err == nil {
		dirs = append(dirs, filepath.Join("/sys/fs/cgroup", root)) // a pure v2 host
	}
	return dirs
}

// removeCgroups removes root's cgroups, deepest first, in every hierarchy; a cgroup that is
// still busy (its last process exiting) is tried again for a while.
func removeCgroups(root string) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		var left []string
		for _, top := range cgroupDirs(root) {
			var dirs []string
			_ = filepath.WalkDir(top, func(path string, d fs.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					dirs = append(dirs, path)
				}
				return nil
			})
			slices.Reverse(dirs)
			for _, d := range dirs {
				if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
					left = append(left, d)
				}
			}
		}
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroups left: %v", left)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// hostPaths are the places on a host where a kubelet and containerd keep their state; the
// node's are its mount namespace's, so none of them may appear on the host.
var hostPaths = []string{"/var/lib/kubelet", "/var/lib/containerd", "/run/containerd", "/var/log/pods",
	"/var/log/containers", "/var/lib/cni", "/run/runc", "/opt/containerd", "/var/run/kubernetes"}

// trace is what identifies a cluster on the host, recorded while it runs, so that Gone can
// look for it once the namespaces' files are gone. The namespaces themselves are held from
// record until the end of Close, which looks for processes left in them (see holder).
type trace struct {
	netns      []string // network namespace names
	held       holder   // the network namespaces and the node's mount namespace
	left       []error  // processes Close found left in them
	cgroupRoot string
	dir        string          // the state directory
	runDir     string          // the run directory (see run)
	hostPaths  map[string]bool // which of hostPaths the host had before
}

func existing(paths []string) map[string]bool {
	m := map[string]bool{}
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			m[p] = true
		}
	}
	return m
}

// record notes the running cluster's trace.
func (c *Cluster) record() error {
	c.trace.netns = []string{c.Netns, c.Outside}
	for _, n := range c.Nodes {
		c.trace.netns = append(c.trace.netns, n.Netns)
	}
	for _, ns := range c.trace.netns {
		if err := c.trace.held.hold(netnsPath(ns), "net"); err != nil {
			return err
		}
	}
	for _, n := range c.Nodes {
		if err := c.trace.held.hold(n.mnt.path(), "mnt"); err != nil {
			return err
		}
	}
	c.trace.cgroupRoot, c.trace.dir, c.trace.runDir = c.CgroupRoot, c.Dir, c.run.dir
	return nil
}

// checkLeft notes, at the end of Close, the processes left in the cluster's namespaces or
// cgroups, and releases the namespaces. A process killed a moment ago may still be on its way
// out: it is given a few seconds.
func (t *trace) checkLeft() {
	defer t.held.release()
	if t.cgroupRoot == "" {
		return // never recorded
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if t.left = t.leftProcesses(); len(t.left) == 0 || time.Now().After(deadline) {
			return
		}
	}
}

// leftProcesses are the processes in one of the cluster's namespaces or cgroups, but this one:
// its threads enter the namespaces for the tests' sockets, and one the Go runtime cannot end
// (the main thread) stays where it was until the test binary exits.
func (t *trace) leftProcesses() []error {
	var errs []error
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return []error{err}
	}
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err != nil || pid == os.Getpid() {
			continue
		}
		dir := "/proc/" + e.Name()
		if l := t.held.in(dir); l != "" {
			errs = append(errs, fmt.Errorf("process %s (%s) is left in the cluster's namespace %s", e.Name(), comm(dir), l))
		}
		if inCgroup(dir+"/cgroup", t.cgroupRoot) {
			errs = append(errs, fmt.Errorf("process %s (%s) is left in cgroup %s", e.Name(), comm(dir), t.cgroupRoot))
		}
	}
	return errs
}

// Gone checks, after Close, that nothing of the cluster is left on the host: no network
// namespace, no process in one of its namespaces or cgroups, no cgroup, no mount, no state or
// run directory, no host path of a kubelet or containerd that the host did not have before.
func (c *Cluster) Gone() error {
	var errs []error
	for _, ns := range c.trace.netns {
		if _, err := os.Lstat(netnsPath(ns)); err == nil {
			errs = append(errs, fmt.Errorf("network namespace %s is left", ns))
		}
	}
	errs = append(errs, c.trace.left...)
	if dirs := cgroupDirs(c.trace.cgroupRoot); len(dirs) > 0 {
		errs = append(errs, fmt.Errorf("cgroups are left: %v", dirs))
	}
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(mi), c.trace.dir) {
		errs = append(errs, fmt.Errorf("a mount of %s is left", c.trace.dir))
	}
	if _, err := os.Lstat(c.trace.runDir); err == nil {
		errs = append(errs, fmt.Errorf("the run directory %s is left", c.trace.runDir))
	}
	for _, p := range hostPaths {
		if _, err := os.Lstat(p); err == nil && !c.trace.hostPaths[p] {
			errs = append(errs, fmt.Errorf("host path %s was made", p))
		}
	}
	return errors.Join(errs...)
}

// makeCgroups makes root's cgroup, and each cgroup above it, in every hierarchy, as the kubelet
// wants its cgroup root to exist; a cpuset gets its parent's CPUs and memory nodes (a v1 cpuset
// starts with none, and a child takes only what its parent has).
func makeCgroups(root string) error {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Type()&fs.ModeSymlink != 0 || !e.IsDir() {
			continue
		}
		parent := filepath.Join("/sys/fs/cgroup", e.Name())
		for _, elem := range strings.Split(strings.Trim(root, "/"), "/") {
			dir := filepath.Join(parent, elem)
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				return err
			}
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				if b, err := os.ReadFile(filepath.Join(parent, f)); err == nil {
					if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
						return fmt.Errorf("cgroup %s: %w", filepath.Join(dir, f), err)
					}
				}
			}
			parent = dir
		}
	}
	return nil
}

// comm is a process's command line, for errors.
func comm(procDir string) string {
	b, _ := os.ReadFile(procDir + "/cmdline")
	return strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
}
