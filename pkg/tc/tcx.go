package tc

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// tcx attaches with tcx links, each pinned as LinkDir/<ifindex>-<direction>: the pin keeps the
// link (and so the program on the device) alive after the process exits, and lets the next
// process find the link and swap its program with BPF_LINK_UPDATE.
type tcx struct {
	opts Options
	log  *slog.Logger

	mu    sync.Mutex
	links map[slot]link.Link // links this process holds, by device and direction
}

type slot struct {
	ifindex int
	dir     Direction
}

func newTCX(opts Options) *tcx {
	return &tcx{opts: opts, log: opts.logger(), links: map[slot]link.Link{}}
}

func (t *tcx) Mode() string { return ModeTCX }

func attachType(d Direction) ebpf.AttachType {
	if d == Ingress {
		return ebpf.AttachTCXIngress
	}
	return ebpf.AttachTCXEgress
}

// position is where a new link of ours goes in the device's chain: egress at the head, ingress
// at the tail (see the package comment). A link that exists keeps its place: replacing its
// program (a restart, an upgrade) never moves it, as moving would mean a moment with two links
// of ours, the second translating again what the first already did.
func position(d Direction) link.Anchor {
	if d == Ingress {
		return link.Tail()
	}
	return link.Head()
}

func (t *tcx) pinPath(s slot) string {
	return filepath.Join(t.opts.LinkDir, fmt.Sprintf("%d-%s", s.ifindex, s.dir))
}

// parsePin reads a pin's file name back.
func parsePin(name string) (slot, bool) {
	idx, dir, ok := strings.Cut(name, "-")
	n, err := strconv.Atoi(idx)
	if !ok || err != nil || n <= 0 {
		return slot{}, false
	}
	switch dir {
	case Egress.String():
		return slot{n, Egress}, true
	case Ingress.String():
		return slot{n, Ingress}, true
	}
	return slot{}, false
}

// held returns the link of a slot: the one this process holds, else the pinned one; nil when
// there is neither.
func (t *tcx) held(s slot) (link.Link, error) {
	if l := t.links[s]; l != nil {
		return l, nil
	}
	l, err := link.LoadPinnedLink(t.pinPath(s), nil)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("load pinned link %s: %w", t.pinPath(s), err)
	}
	t.links[s] = l
	return l, nil
}

// attachedTo returns the program of a link that is still attached to the slot's device and
// direction, or false for a link that was detached (its device went away, or someone detached
// it) or attached elsewhere.
func attachedTo(l link.Link, s slot) (ebpf.ProgramID, bool, error) {
	info, err := l.Info()
	if err != nil {
		return 0, false, err
	}
	x := info.TCX()
	if x == nil || int(x.Ifindex) != s.ifindex || ebpf.AttachType(x.AttachType) != attachType(s.dir) {
		return 0, false, nil
	}
	return info.Program, true, nil
}

func progID(p *ebpf.Program) (ebpf.ProgramID, error) {
	info, err := p.Info()
	if err != nil {
		return 0, fmt.Errorf("program info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return 0, errors.New("the kernel does not report program ids")
	}
	return id, nil
}

func (t *tcx) Attach(ctx context.Context, ifindex int, dir Direction, prog *ebpf.Program) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	s := slot{ifindex, dir}
	want, err := progID(prog)
	if err != nil {
		return err
	}
	l, err := t.held(s)
	if err != nil {
		return err
	}
	if l != nil {
		cur, ok, err := attachedTo(l, s)
		if err != nil {
			return fmt.Errorf("tcx link of ifindex %d %s: %w", ifindex, dir, err)
		}
		if ok && cur != want {
			// The restart case: swap the program, the device never runs without one.
			if err := l.Update(prog); err != nil {
				return fmt.Errorf("replace program of tcx link on ifindex %d %s: %w", ifindex, dir, err)
			}
			t.log.Info("program replaced in place", "mode", ModeTCX, "ifindex", ifindex, "direction", dir.String())
		}
		if !ok {
			t.log.Info("pinned tcx link is no longer attached; attaching anew", "ifindex", ifindex, "direction", dir.String())
			t.forget(s, l)
			l = nil
		} else if !t.hasPin(s) {
			// Without its pin the link would go with this process: pin it again.
			if err := l.Unpin(); err != nil {
				return fmt.Errorf("tcx link of ifindex %d %s: forget the lost pin: %w", ifindex, dir, err)
			}
			if err := l.Pin(t.pinPath(s)); err != nil {
				return fmt.Errorf("pin tcx link of ifindex %d %s again: %w", ifindex, dir, err)
			}
			t.log.Info("tcx link pin was missing; pinned again", "ifindex", ifindex, "direction", dir.String())
		}
	}
	if l == nil {
		if err := os.MkdirAll(t.opts.LinkDir, 0o700); err != nil {
			return fmt.Errorf("create link pin directory: %w", err)
		}
		nl, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: attachType(dir), Anchor: position(dir)})
		if err != nil {
			return fmt.Errorf("attach tcx to ifindex %d %s: %w", ifindex, dir, err)
		}
		if err := nl.Pin(t.pinPath(s)); err != nil {
			nl.Close()
			return fmt.Errorf("pin tcx link of ifindex %d %s: %w", ifindex, dir, err)
		}
		t.links[s] = nl
		l = nl
		t.log.Info("attached", "mode", ModeTCX, "ifindex", ifindex, "direction", dir.String())
	}
	// Ours without a pin here (for example pinned on another bpffs by an agent run with other
	// flags) would run the programs a second time: remove them.
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("tcx link of ifindex %d %s: %w", ifindex, dir, err)
	}
	return t.detachOthers(ifindex, dir, info.ID)
}

// hasPin tells whether the slot's link pin exists.
func (t *tcx) hasPin(s slot) bool {
	_, err := os.Lstat(t.pinPath(s))
	return err == nil
}

// Runs implements Hook: the link this process holds (or the pinned one) is attached to the
// device at dir and runs prog.
func (t *tcx) Runs(ctx context.Context, ifindex int, dir Direction, prog *ebpf.Program) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	want, err := progID(prog)
	if err != nil {
		return false, err
	}
	s := slot{ifindex, dir}
	l, err := t.held(s)
	if err != nil || l == nil {
		return false, err
	}
	cur, ok, err := attachedTo(l, s)
	if err != nil {
		return false, fmt.Errorf("tcx link of ifindex %d %s: %w", ifindex, dir, err)
	}
	if !ok && !deviceExists(ifindex) {
		// The kernel detaches a device's links when it goes.
		return false, fmt.Errorf("ifindex %d: %w", ifindex, ErrNoDevice)
	}
	return ok && cur == want, nil
}

// deviceExists asks the kernel for the device's name: one ioctl, where net.InterfaceByIndex
// would dump every device of the namespace.
func deviceExists(ifindex int) bool {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return true // cannot tell: let the caller take it for present
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("")
	if err != nil {
		return true
	}
	ifr.SetUint32(uint32(ifindex))
	return !errors.Is(unix.IoctlIfreq(fd, unix.SIOCGIFNAME, ifr), unix.ENODEV)
}

// forget drops a link: its pin, and this process's descriptor.
func (t *tcx) forget(s slot, l link.Link) {
	if err := os.Remove(t.pinPath(s)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.log.Warn("cannot remove link pin", "path", t.pinPath(s), "error", err)
	}
	l.Close()
	delete(t.links, s)
}

// attachedOwned lists the programs of ours on a device and direction, with their link ids.
func (t *tcx) attachedOwned(ifindex int, dir Direction) ([]Attachment, []link.ID, error) {
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: attachType(dir)})
	if errors.Is(err, unix.ENODEV) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	var out []Attachment
	var ids []link.ID
	for _, ap := range res.Programs {
		lid, ok := ap.LinkID()
		if !ok || t.opts.Owns == nil {
			continue
		}
		p, err := ebpf.NewProgramFromID(ap.ID)
		if err != nil {
			continue // gone meanwhile
		}
		info, err := p.Info()
		p.Close()
		if err != nil || !t.opts.Owns(info) {
			continue
		}
		out = append(out, Attachment{Mode: ModeTCX, Ifindex: ifindex, Dir: dir, Program: ap.ID})
		ids = append(ids, lid)
	}
	return out, ids, nil
}

// detachOthers detaches the links of ours on the device other than keep.
func (t *tcx) detachOthers(ifindex int, dir Direction, keep link.ID) error {
	found, ids, err := t.attachedOwned(ifindex, dir)
	if err != nil {
		return fmt.Errorf("query tcx programs of ifindex %d %s: %w", ifindex, dir, err)
	}
	for i, id := range ids {
		if id == keep {
			continue
		}
		if err := detachID(id); err != nil {
			return err
		}
		t.log.Info("detached a second attachment of ours", "mode", ModeTCX, "ifindex", ifindex,
			"direction", dir.String(), "program", found[i].Program)
	}
	return nil
}

func detachID(id link.ID) error {
	l, err := link.NewFromID(id)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open tcx link %d: %w", id, err)
	}
	defer l.Close()
	if err := l.Detach(); err != nil {
		return fmt.Errorf("detach tcx link %d: %w", id, err)
	}
	return nil
}

func (t *tcx) Detach(ctx context.Context, ifindex int, dir Direction) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	s := slot{ifindex, dir}
	l, err := t.held(s)
	if err != nil {
		return err
	}
	if l != nil {
		if _, ok, err := attachedTo(l, s); err == nil && ok {
			if err := l.Detach(); err != nil {
				return fmt.Errorf("detach tcx link of ifindex %d %s: %w", ifindex, dir, err)
			}
			t.log.Info("detached", "mode", ModeTCX, "ifindex", ifindex, "direction", dir.String())
		}
		t.forget(s, l)
	}
	err = t.detachOthers(ifindex, dir, 0)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, ebpf.ErrNotSupported) {
		return nil // no tcx on this kernel: nothing of ours can be there
	}
	return err
}

func (t *tcx) List(ctx context.Context) ([]Attachment, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	seen := map[slot]bool{}
	var out []Attachment
	entries, err := os.ReadDir(t.opts.LinkDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read link pins: %w", err)
	}
	for _, e := range entries {
		s, ok := parsePin(e.Name())
		if !ok {
			continue
		}
		l, err := t.held(s)
		if err != nil || l == nil {
			continue
		}
		if p, ok, err := attachedTo(l, s); err == nil && ok {
			out = append(out, Attachment{Mode: ModeTCX, Ifindex: s.ifindex, Dir: s.dir, Program: p})
			seen[s] = true
		}
	}
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("list devices: %w", err)
	}
	for _, ifc := range ifaces {
		for _, d := range Directions() {
			found, _, err := t.attachedOwned(ifc.Index, d)
			if errors.Is(err, unix.EINVAL) || errors.Is(err, ebpf.ErrNotSupported) {
				return out, nil // no tcx on this kernel
			}
			if err != nil {
				return nil, fmt.Errorf("query tcx programs of %s %s: %w", ifc.Name, d, err)
			}
			for _, a := range found {
				if !seen[slot{a.Ifindex, a.Dir}] {
					out = append(out, a)
				}
			}
		}
	}
	return out, nil
}

// pinned lists the devices with a link pin.
func (t *tcx) pinned() ([]int, error) {
	entries, err := os.ReadDir(t.opts.LinkDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read link pins: %w", err)
	}
	var out []int
	for _, e := range entries {
		if s, ok := parsePin(e.Name()); ok && !slices.Contains(out, s.ifindex) {
			out = append(out, s.ifindex)
		}
	}
	return out, nil
}

// removePins removes the link pins that are left (detached links) and the directory.
func (t *tcx) removePins() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	entries, err := os.ReadDir(t.opts.LinkDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read link pins: %w", err)
	}
	for _, e := range entries {
		if s, ok := parsePin(e.Name()); ok {
			if l := t.links[s]; l != nil {
				l.Close()
				delete(t.links, s)
			}
		}
		if err := os.Remove(filepath.Join(t.opts.LinkDir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove link pin: %w", err)
		}
	}
	if err := os.Remove(t.opts.LinkDir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove link pin directory: %w", err)
	}
	return nil
}

func (t *tcx) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	for s, l := range t.links {
		errs = append(errs, l.Close())
		delete(t.links, s)
	}
	return errors.Join(errs...)
}
