package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"golang.org/x/sys/unix"
)

// A run is one control plane's (and its node's) life on this machine. Its id names all it
// makes: the network namespaces NetnsPrefix+ROLE+"-"+id, the cgroup root "/"+NetnsPrefix+id
// and the run directory os.TempDir()/NetnsPrefix+id (the state directory, unless the caller
// chose one), which holds the owner lock: a file the run's process keeps flock'ed while it
// lives. A test binary killed by go test's timeout leaves its cluster behind (the pods and
// containerd's shims are not its children; Pdeathsig ends only the components), but its lock
// dies with it, so a later run's Reap knows the leftovers are a dead run's and removes them.
// A run whose process lives is never touched, whatever its age.

// lockName is the owner lock's file in the run directory.
const lockName = "owner.lock"

type run struct {
	id, dir string
	lock    *os.File
}

// newRun picks a free id, makes its run directory and takes its owner lock. The lock is taken
// before the file gets its name, so Reap never finds a lock of a live run free.
func newRun() (*run, error) {
	for range 8 {
		var b [4]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, err
		}
		id := hex.EncodeToString(b[:])
		dir := filepath.Join(os.TempDir(), NetnsPrefix+id)
		if err := os.Mkdir(dir, 0o700); errors.Is(err, fs.ErrExist) {
			continue
		} else if err != nil {
			return nil, err
		}
		lock, err := takeLock(dir)
		if err != nil {
			return nil, errors.Join(err, os.RemoveAll(dir))
		}
		return &run{id: id, dir: dir, lock: lock}, nil
	}
	return nil, errors.New("no free run id")
}

func takeLock(dir string) (*os.File, error) {
	tmp := filepath.Join(dir, lockName+".new")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil, errors.Join(fmt.Errorf("lock %s: %w", tmp, err), f.Close())
	}
	if err := os.Rename(tmp, filepath.Join(dir, lockName)); err != nil {
		return nil, errors.Join(err, f.Close())
	}
	return f, nil
}

// cgroupRoot is the run's cgroup root, which holds each node's kubelet's (Node.CgroupRoot).
func (r *run) cgroupRoot() string { return "/" + NetnsPrefix + r.id }

// netnsName is the name of the run's network namespace of a role (cp, out, node: node 1's,
// node-N: node N's).
func (r *run) netnsName(role string) string { return NetnsPrefix + role + "-" + r.id }

// end removes the run directory and drops the lock when the teardown left nothing behind;
// otherwise it only drops the lock, so that the next Reap finishes the teardown.
func (r *run) end(clean bool) error {
	if r.lock == nil {
		return nil // ended before
	}
	var err error
	if clean {
		err = os.RemoveAll(r.dir)
	}
	err = errors.Join(err, r.lock.Close())
	r.lock = nil
	return err
}

// reapT is Reap for a test: what it removed is logged, a failure too (a dead run's leftovers
// are no reason to fail this one).
func reapT(t testing.TB) {
	reaped, err := Reap(context.Background())
	if len(reaped) > 0 {
		t.Logf("removed the leftovers of dead runs %v", reaped)
	}
	if err != nil {
		t.Logf("removing the leftovers of dead runs: %v", err)
	}
}

// Reap removes what dead runs left on the machine (see run): for each run directory whose
// owner lock is free, every process in the run's network namespaces or below its cgroup root
// (killed by PID), the cgroups, the network namespaces and the run directory. It returns the
// ids of the runs it removed.
func Reap(ctx context.Context) ([]string, error) {
	locks, err := filepath.Glob(filepath.Join(os.TempDir(), NetnsPrefix+"*", lockName))
	if err != nil {
		return nil, err
	}
	var reaped []string
	var errs []error
	for _, path := range locks {
		dir := filepath.Dir(path)
		r := &run{id: strings.TrimPrefix(filepath.Base(dir), NetnsPrefix), dir: dir}
		dead, err := r.claim(path)
		if err != nil || !dead {
			errs = append(errs, err)
			continue
		}
		err = r.reap(ctx)
		if err == nil {
			reaped = append(reaped, r.id)
		}
		errs = append(errs, err, r.end(err == nil))
	}
	return reaped, errors.Join(errs...)
}

// claim takes a run's owner lock if its owner is dead. A lock whose file is no longer at path
// was its owner's at the end of a clean teardown: nothing to reap.
func (r *run) claim(path string) (bool, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	} else if err != nil {
		return false, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return false, nil // alive
		}
		return false, fmt.Errorf("lock %s: %w", path, err)
	}
	var held, named syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &held) != nil || syscall.Stat(path, &named) != nil || held.Ino != named.Ino {
		f.Close()
		return false, nil
	}
	r.lock = f
	return true, nil
}

// reap kills the run's processes, then removes its cgroups and network namespaces.
func (r *run) reap(ctx context.Context) error {
	var names []string
	var hold holder
	defer hold.release()
	paths, err := filepath.Glob(netnsPath(r.netnsName("*")))
	if err != nil {
		return err
	}
	for _, path := range paths {
		if err := hold.hold(path, "net"); err != nil {
			return err
		}
		names = append(names, filepath.Base(path))
	}
	if err := killAll(func() ([]int, error) { return hold.processes(r.cgroupRoot(), 0) }); err != nil {
		return fmt.Errorf("reap run %s: %w", r.id, err)
	}
	errs := []error{removeCgroups(r.cgroupRoot())}
	for _, name := range names {
		errs = append(errs, testutil.DeleteNetns(ctx, name))
	}
	return errors.Join(errs...)
}
