// Package nodelock keeps one ip-masq-agent at a time programming a node, whatever its backend:
// the process that holds the lock is the one that may change the datapath (an agent), or
// remove it (`cleanup`).
//
// The lock is an abstract unix socket, bound in the network namespace the process runs in.
// That is the node's own namespace for the DaemonSet (hostNetwork), and it is the scope of what
// the agent programs (tc programs on its devices, netfilter rules), so one name serves one
// node: no file or mount is needed, the kernel releases the name when the holder dies however
// it dies (SIGKILL, OOM), and each test namespace has a lock of its own. Sockets are opened
// close-on-exec, so a child (iptables-restore) never inherits the lock.
//
// The holder answers every connection to the socket with one JSON line saying who it is
// (Holder), so that a process that finds the lock taken can say by whom; the kernel adds the
// holder's uid (SO_PEERCRED), which tells an agent from another process that took the name
// (abstract names have no permissions: any process of the namespace can bind one).
package nodelock

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Name is the abstract socket name of the agent's lock ("@ip-masq-agent" in `ss -xl`).
const Name = "ip-masq-agent"

// PollInterval is how often a waiting process tries the lock again: the bound on how long a
// takeover waits after the holder exits.
const PollInterval = 100 * time.Millisecond

// describeTimeout bounds reading the holder's description.
const describeTimeout = time.Second

// Holder says who holds the lock.
type Holder struct {
	// Command is what the holder runs: "agent" or "cleanup".
	Command string `json:"command"`
	// Pid is the holder's process id, in its own pid namespace (a container's).
	Pid     int       `json:"pid"`
	Version string    `json:"version"`
	Since   time.Time `json:"since"`
	// UID is the holder's user id as the kernel reports it (-1 when unknown), not what the
	// holder says.
	UID int `json:"-"`
}

func (h Holder) String() string {
	if h.Command == "" {
		return fmt.Sprintf("another process (uid %d), which does not say who it is", h.UID)
	}
	return fmt.Sprintf("ip-masq-agent %s (pid %d, uid %d, version %s, since %s)", h.Command, h.Pid, h.UID,
		h.Version, h.Since.Format(time.RFC3339))
}

// HeldError is the error of TryAcquire when another process holds the lock.
type HeldError struct {
	Holder Holder
}

func (e *HeldError) Error() string { return "the node lock is held by " + e.Holder.String() }

// Lock is a held lock.
type Lock struct {
	ln   *net.UnixListener
	once sync.Once
	done chan struct{}
}

// TryAcquire takes the lock named name for me, or fails at once: with a *HeldError when another
// process holds it.
func TryAcquire(name string, me Holder) (*Lock, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + name, Net: "unix"})
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, &HeldError{Holder: Describe(name)}
	}
	if err != nil {
		return nil, fmt.Errorf("take the node lock @%s: %w", name, err)
	}
	line, err := json.Marshal(me)
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("take the node lock: %w", err)
	}
	l := &Lock{ln: ln, done: make(chan struct{})}
	go l.serve(append(line, '\n'))
	return l, nil
}

// Acquire takes the lock named name for me, waiting as long as another process holds it (until
// ctx ends). waiting is called, before the wait, with each holder it waits for (once per
// holder, not at every try).
func Acquire(ctx context.Context, name string, me Holder, waiting func(Holder)) (*Lock, error) {
	var last *Holder
	for {
		l, err := TryAcquire(name, me)
		held, isHeld := errors.AsType[*HeldError](err)
		if !isHeld {
			return l, err
		}
		if last == nil || *last != held.Holder {
			last = &held.Holder
			if waiting != nil {
				waiting(held.Holder)
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the node lock, held by %s: %w", held.Holder, ctx.Err())
		case <-time.After(PollInterval):
		}
	}
}

// serve answers each connection with line, until Release.
func (l *Lock) serve(line []byte) {
	for {
		c, err := l.ln.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(PollInterval) // e.g. EMFILE: do not spin
			continue
		}
		_ = c.SetWriteDeadline(time.Now().Add(describeTimeout))
		_, _ = c.Write(line)
		c.Close()
	}
}

// Release gives the lock up; a waiting process takes it within PollInterval. Releasing twice
// is fine.
func (l *Lock) Release() error {
	var err error
	l.once.Do(func() {
		close(l.done)
		err = l.ln.Close()
	})
	return err
}

// Describe asks the holder of the lock who it is. Nothing holding the lock gives the zero
// Holder; a holder that does not answer, one with only its UID.
func Describe(name string) Holder {
	c, err := net.DialTimeout("unix", "@"+name, describeTimeout)
	if err != nil {
		return Holder{}
	}
	defer c.Close()
	uid := peerUID(c.(*net.UnixConn))
	_ = c.SetReadDeadline(time.Now().Add(describeTimeout))
	var h Holder
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil || json.Unmarshal(line, &h) != nil {
		h = Holder{}
	}
	h.UID = uid
	return h
}

// peerUID is the uid of the process at the other end of c, or -1.
func peerUID(c *net.UnixConn) int {
	uid := -1
	rc, err := c.SyscallConn()
	if err != nil {
		return uid
	}
	_ = rc.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			uid = int(cred.Uid)
		}
	})
	return uid
}

// Me describes this process as the holder of the lock for command.
func Me(command, version string) Holder {
	return Holder{Command: command, Pid: os.Getpid(), Version: version, Since: time.Now(), UID: os.Getuid()}
}
