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
// (abstract names have no permissions: any process of the namespace can bind one), and its pid
// as seen from the asker's pid namespace, 0 outside it, which tells a container whether the
// holder is its own agent (Holder.LocalPid).
//
// A newer agent may then ask the holder to hand the node over (a rollout with maxSurge starts
// the new pod beside the old one): after the holder's line it sends one JSON line naming
// itself, and a holder it supersedes (Holder.Supersedes: both agents, of known pod template
// generations, the asker's the later; the same uid) agrees in one line, once. The holder is
// told (Lock.HandOvers), stops changing the datapath, frees what the newer agent needs (its
// metrics port) and releases the lock, which the newer agent takes at its next try. Any other
// answer leaves the newer agent waiting for the holder's exit, as does a holder of a release
// before the handover, which hangs up after its line.
//
// A client may instead send a query (Ask), which the holder answers in one JSON line when it
// was given that query's answer (Lock.Answer): the agent answers "config" with the
// configuration it applied, which `explain` and `dump` read. A holder without that answer
// (cleanup, a release before queries) hangs up after its line.
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
	// Generation orders the agents of a DaemonSet: the template generation of the agent's pod
	// (the pod-template-generation label the DaemonSet controller gives its pods, raised by
	// every change of the pod template, a rollback's too); 0 when unknown.
	Generation int64 `json:"generation,omitempty"`
	// UID is the holder's user id as the kernel reports it (-1 when unknown), not what the
	// holder says.
	UID int `json:"-"`
	// LocalPid is the holder's pid in the asker's pid namespace, as the kernel reports it: 0
	// when the holder is not in that namespace (another container's agent) or unknown.
	LocalPid int `json:"-"`
}

// Supersedes reports whether agent h is to take the node over from agent old: both are agents
// of known generations and h's is the later. The generation is the pod's, not the process's:
// a container the kubelet restarts in the old pod keeps the old generation, so it never takes
// the node back from the newer pod's agent, and two agents never hand the node to and fro.
func (h Holder) Supersedes(old Holder) bool {
	return h.Command == "agent" && old.Command == "agent" && old.Generation > 0 && h.Generation > old.Generation
}

func (h Holder) String() string {
	if h.Command == "" {
		return fmt.Sprintf("another process (uid %d), which does not say who it is", h.UID)
	}
	gen := ""
	if h.Generation > 0 {
		gen = fmt.Sprintf(", generation %d", h.Generation)
	}
	return fmt.Sprintf("ip-masq-agent %s (pid %d, uid %d, version %s%s, since %s)", h.Command, h.Pid, h.UID,
		h.Version, gen, h.Since.Format(time.RFC3339))
}

// HeldError is the error of TryAcquire when another process holds the lock.
type HeldError struct {
	Holder Holder
}

func (e *HeldError) Error() string { return "the node lock is held by " + e.Holder.String() }

// Lock is a held lock.
type Lock struct {
	ln   *net.UnixListener
	me   Holder
	once sync.Once
	done chan struct{}

	handOvers chan Holder // receives the agent handed over to, once
	mu        sync.Mutex
	agreed    bool                           // a handover was agreed: no second one
	answers   map[string]func() (any, error) // the queries the holder answers (Answer)
}

// request is the line a client sends after the holder's: a newer agent's handover request
// (answered with a handOverReply), or a query (answered with a queryReply).
type request struct {
	HandOver *Holder `json:"handOver,omitempty"`
	Query    string  `json:"query,omitempty"`
}

// queryReply is the holder's answer to a query: the answer, or why there is none.
type queryReply struct {
	Answer json.RawMessage `json:"answer,omitempty"`
	Error  string          `json:"error,omitempty"`
}

type handOverReply struct {
	Agreed bool   `json:"agreed"`
	Reason string `json:"reason,omitempty"`
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
	// The channel exists from the start, so that an agent asking at once is not refused.
	l := &Lock{ln: ln, me: me, done: make(chan struct{}), handOvers: make(chan Holder, 1)}
	go l.serve(append(line, '\n'))
	return l, nil
}

// HandOvers receives the agent this holder has agreed to hand the node over to (once: later
// requests are refused). A holder that an agent can supersede (an agent of a known generation)
// must follow it: stop changing the datapath, close what the newer agent needs and Release.
func (l *Lock) HandOvers() <-chan Holder { return l.handOvers }

// consider decides a handover request from the agent from.
func (l *Lock) consider(from Holder) handOverReply {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.me.Command != "agent" || l.me.Generation == 0:
		return handOverReply{Reason: "the holder does not hand over"}
	case from.UID != l.me.UID:
		return handOverReply{Reason: fmt.Sprintf("the requester's uid %d is not the holder's", from.UID)}
	case !from.Supersedes(l.me):
		return handOverReply{Reason: fmt.Sprintf("generation %d does not supersede the holder's %d", from.Generation, l.me.Generation)}
	case l.agreed:
		return handOverReply{Reason: "the holder already hands over to another agent"}
	}
	l.agreed = true
	l.handOvers <- from
	return handOverReply{Agreed: true}
}

// Wait is what Acquire waits for.
type Wait struct {
	Holder Holder
	// HandingOver says the holder agreed to hand the node over to this agent, which supersedes
	// it; Refused, why a holder this agent supersedes did not agree.
	HandingOver bool
	Refused     string
}

// Acquire takes the lock named name for me, waiting as long as another process holds it (until
// ctx ends). A holder that me supersedes is asked to hand the node over. waiting is called,
// before the wait, with each holder it waits for (once per holder, not at every try).
func Acquire(ctx context.Context, name string, me Holder, waiting func(Wait)) (*Lock, error) {
	var last *Holder
	for {
		l, err := TryAcquire(name, me)
		held, isHeld := errors.AsType[*HeldError](err)
		if !isHeld {
			return l, err
		}
		if last == nil || *last != held.Holder {
			last = &held.Holder
			w := Wait{Holder: held.Holder}
			if me.Supersedes(held.Holder) {
				w.HandingOver, w.Refused = askHandOver(name, me)
			}
			if waiting != nil {
				waiting(w)
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the node lock, held by %s: %w", held.Holder, ctx.Err())
		case <-time.After(PollInterval):
		}
	}
}

// askHandOver asks the holder of the lock named name to hand the node over to me, and returns
// whether it agreed, and if not why.
func askHandOver(name string, me Holder) (bool, string) {
	c, err := net.DialTimeout("unix", "@"+name, describeTimeout)
	if err != nil {
		return false, err.Error()
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(describeTimeout))
	req, err := json.Marshal(request{HandOver: &me})
	if err != nil {
		return false, err.Error()
	}
	r := bufio.NewReader(c)
	if _, err := r.ReadBytes('\n'); err != nil { // the holder's line
		return false, "the holder does not answer: " + err.Error()
	}
	// A holder of a release before the handover hangs up after its line.
	const before = "the holder does not hand over (a release before the handover)"
	if _, err := c.Write(append(req, '\n')); err != nil {
		return false, before
	}
	var reply handOverReply
	line, err := r.ReadBytes('\n')
	if err != nil {
		return false, before
	}
	if err := json.Unmarshal(line, &reply); err != nil {
		return false, fmt.Sprintf("the holder's answer %q: %v", line, err)
	}
	return reply.Agreed, reply.Reason
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
		go l.answer(c.(*net.UnixConn), line)
	}
}

// answer writes line to a client, then reads whether it asks for a handover (a Describe hangs
// up instead) and answers that.
func (l *Lock) answer(c *net.UnixConn, line []byte) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(describeTimeout))
	if _, err := c.Write(line); err != nil {
		return
	}
	b, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		return
	}
	var req request
	if json.Unmarshal(b, &req) != nil {
		return
	}
	if req.Query != "" {
		l.answerQuery(c, req.Query)
		return
	}
	if req.HandOver == nil {
		return
	}
	from := *req.HandOver
	from.UID, _ = peerCred(c)
	reply, err := json.Marshal(l.consider(from))
	if err == nil {
		_, _ = c.Write(append(reply, '\n'))
	}
}

// queryTimeout bounds a query, from the asker's connection to the end of the answer: an answer
// may be large (a configuration of 100k CIDRs).
const queryTimeout = 10 * time.Second

// ErrNoAnswer is what Ask returns, wrapped, when the holder does not answer the query: it
// answers no such query (another command, a release before the query), or nothing holds the
// lock.
var ErrNoAnswer = errors.New("the holder does not answer")

// Answer makes the holder answer the query named query, from now on, with what fn returns
// (marshalled as JSON), or with fn's error.
func (l *Lock) Answer(query string, fn func() (any, error)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.answers == nil {
		l.answers = map[string]func() (any, error){}
	}
	l.answers[query] = fn
}

// answerQuery answers a query on c; a query the holder does not answer gets no reply.
func (l *Lock) answerQuery(c *net.UnixConn, query string) {
	l.mu.Lock()
	fn := l.answers[query]
	l.mu.Unlock()
	if fn == nil {
		return
	}
	_ = c.SetDeadline(time.Now().Add(queryTimeout))
	var reply queryReply
	v, err := fn()
	if err == nil {
		reply.Answer, err = json.Marshal(v)
	}
	if err != nil {
		reply = queryReply{Error: err.Error()}
	}
	line, err := json.Marshal(reply)
	if err == nil {
		_, _ = c.Write(append(line, '\n'))
	}
}

// Ask sends the holder of the lock named name the query, and decodes its answer into v. It
// returns who the holder is (the zero Holder when nothing holds the lock), and an error
// wrapping ErrNoAnswer when the holder does not answer the query, or the holder's error.
func Ask(name, query string, v any) (Holder, error) {
	c, err := net.DialTimeout("unix", "@"+name, describeTimeout)
	if err != nil {
		return Holder{}, fmt.Errorf("%w: nothing holds the node lock @%s", ErrNoAnswer, name)
	}
	defer c.Close()
	var h Holder
	h.UID, h.LocalPid = peerCred(c.(*net.UnixConn))
	_ = c.SetDeadline(time.Now().Add(describeTimeout))
	r := bufio.NewReader(c)
	line, err := r.ReadBytes('\n')
	if err != nil || json.Unmarshal(line, &h) != nil {
		return h, fmt.Errorf("%w: %s", ErrNoAnswer, h)
	}
	req, err := json.Marshal(request{Query: query})
	if err != nil {
		return h, err
	}
	_ = c.SetDeadline(time.Now().Add(queryTimeout))
	if _, err := c.Write(append(req, '\n')); err != nil {
		return h, fmt.Errorf("%w: %s", ErrNoAnswer, h)
	}
	line, err = r.ReadBytes('\n')
	if err != nil {
		return h, fmt.Errorf("%w %s: %s", ErrNoAnswer, query, h)
	}
	var reply queryReply
	if err := json.Unmarshal(line, &reply); err != nil {
		return h, fmt.Errorf("the answer of %s to %s: %w", h, query, err)
	}
	if reply.Error != "" {
		return h, fmt.Errorf("%s: %s", h, reply.Error)
	}
	if err := json.Unmarshal(reply.Answer, v); err != nil {
		return h, fmt.Errorf("the answer of %s to %s: %w", h, query, err)
	}
	return h, nil
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
	uid, pid := peerCred(c.(*net.UnixConn))
	_ = c.SetReadDeadline(time.Now().Add(describeTimeout))
	var h Holder
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil || json.Unmarshal(line, &h) != nil {
		h = Holder{}
	}
	h.UID, h.LocalPid = uid, pid
	return h
}

// peerCred is the uid of the process at the other end of c (-1 when unknown) and its pid in
// this process's pid namespace (0 when it is not in it, or unknown): the kernel translates it.
func peerCred(c *net.UnixConn) (uid, pid int) {
	uid = -1
	rc, err := c.SyscallConn()
	if err != nil {
		return uid, 0
	}
	_ = rc.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			uid, pid = int(cred.Uid), int(cred.Pid)
		}
	})
	return uid, pid
}

// Me describes this process as the holder of the lock for command.
func Me(command, version string) Holder {
	return Holder{Command: command, Pid: os.Getpid(), Version: version, Since: time.Now(), UID: os.Getuid()}
}
