// Package tc attaches a pair of tc programs (egress and ingress) to network devices, and finds
// and removes them again from another process: with tcx links (Linux 6.6+), pinned so that they
// outlive the process, or with clsact and cls_bpf filters through netlink, which outlive it by
// nature. Either way a new process replaces the programs in place, without a moment in which a
// device runs none.
//
// A Hook is one attachment mechanism; a Manager attaches with one and removes what the other
// left on the same devices, so that a device never runs the programs twice.
//
// Sharing the hooks. Other components attach programs to the same devices (a CNI, kube-proxy's
// replacement, monitoring agents). Ours let the chain go on (TC_ACT_UNSPEC, which is TCX_NEXT)
// on every path that neither drops nor redirects, and sit where netfilter's NAT sits relative to
// tc: next to the IP stack. So every neighbour sees the addresses of the wire in both directions,
// as it would beside iptables MASQUERADE (POSTROUTING runs before tc egress, PREROUTING after tc
// ingress), and a CNI that tracks connections on both hooks sees one tuple per connection:
//
//   - egress: a new tcx link of ours goes at the head of the chain, so every program after it
//     sees packets as masqueraded;
//   - ingress: at the tail, so every program before it sees replies still addressed to the node.
//
// A tc filter of ours sits at Options.FilterPriority on both hooks: filters of a lower priority
// run before it, and every tcx program runs before any filter. A program ahead of ours that
// ends the chain (TCX_PASS, TC_ACT_OK) takes the packets it passes past ours: Neighbours lists
// them, for the caller to report.
package tc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Attach modes: the names the datapath_info metric and the logs use. ModeAuto (or "") asks
// Probe.
const (
	ModeTCX  = "tcx"
	ModeTC   = "tc"
	ModeAuto = "auto"
)

// CheckMode accepts the modes a user may ask for: auto (or empty), tcx or tc.
func CheckMode(mode string) error {
	switch mode {
	case "", ModeAuto, ModeTCX, ModeTC:
		return nil
	}
	return fmt.Errorf("attach mode %q: must be %s, %s or %s", mode, ModeAuto, ModeTCX, ModeTC)
}

// Direction is the hook of a device a program runs at.
type Direction uint8

const (
	Egress Direction = iota
	Ingress
)

func (d Direction) String() string {
	if d == Ingress {
		return "ingress"
	}
	return "egress"
}

// Directions lists both, egress first.
func Directions() []Direction { return []Direction{Egress, Ingress} }

// Programs are what a device gets.
type Programs struct {
	Egress, Ingress *ebpf.Program
}

func (p Programs) get(d Direction) *ebpf.Program {
	if d == Ingress {
		return p.Ingress
	}
	return p.Egress
}

// Attachment is one of our programs on a device.
type Attachment struct {
	Mode    string
	Ifindex int
	Dir     Direction
	Program ebpf.ProgramID
}

// Hook is one way of attaching programs to devices.
//
// Every method is idempotent and safe for concurrent use. "Ours" means attached by a Hook with
// the same Options, in this process or an earlier one.
type Hook interface {
	// Mode is ModeTCX or ModeTC.
	Mode() string
	// Attach makes the device run prog at dir. What of ours is there already is replaced in
	// place (atomically: packets see the old program or the new one), and left alone when it
	// already is prog. Programs of others on the device are kept.
	Attach(ctx context.Context, ifindex int, dir Direction, prog *ebpf.Program) error
	// Detach removes ours from the device at dir; nothing of ours there is not an error, and
	// neither is a device that is gone.
	Detach(ctx context.Context, ifindex int, dir Direction) error
	// Runs tells whether the device runs prog at dir through an attachment of ours, cheaply
	// (a drift check asks every second): one query of the attachment, no scan of devices. A
	// device that is gone fails with an error wrapping ErrNoDevice.
	Runs(ctx context.Context, ifindex int, dir Direction, prog *ebpf.Program) (bool, error)
	// List returns ours on every device of the network namespace.
	List(ctx context.Context) ([]Attachment, error)
	// Close releases what the hook holds; attachments stay.
	Close() error
}

// Options identify our attachments.
type Options struct {
	// LinkDir is the directory on a bpffs where tcx links are pinned, one file per device and
	// direction.
	LinkDir string
	// FilterName prefixes the name of our tc filters ("NAME:prog"); with FilterPriority and
	// FilterHandle it tells our filters from others'.
	FilterName     string
	FilterPriority uint16
	FilterHandle   uint32
	// Owns tells whether an attached program is ours, for programs found on a device without
	// a pin (for example pinned on another bpffs): it lets tcx find and replace them.
	Owns func(*ebpf.ProgramInfo) bool
	// Logger receives what the hooks change; nil discards it.
	Logger *slog.Logger
}

func (o Options) logger() *slog.Logger {
	if o.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return o.Logger.With("component", "tc")
}

// ErrNoDevice is the error of Runs and Manager.Check for a device that does not exist (any
// more).
var ErrNoDevice = errors.New("no such device")

// Probe tells which attach mode the kernel supports: tcx when it has tcx links, else tc. It
// asks the kernel (HaveTCX), rather than guessing from the version; reason says what it found,
// for the logs. Only a kernel that loads no tc program at all is an error: a tcx probe that
// fails otherwise leaves the agent on clsact, which it then says.
func Probe() (mode string, reason string, err error) {
	has, loadErr, attachErr := probeTCX()
	switch {
	case loadErr != nil:
		return "", "", loadErr
	case attachErr != nil:
		return ModeTC, fmt.Sprintf("%v: clsact and cls_bpf", attachErr), nil
	case has:
		return ModeTCX, "the kernel has tcx links", nil
	}
	return ModeTC, "the kernel has no tcx links (Linux 6.6+): clsact and cls_bpf", nil
}

// HaveTCX tells whether the kernel has tcx links, with an error where the probe could not tell
// (no privileges, a sandbox): the tests' question, where only a kernel without them may skip.
func HaveTCX() (bool, error) {
	has, loadErr, attachErr := probeTCX()
	return has, errors.Join(loadErr, attachErr)
}

// probeTCX creates a tcx link on no device: a kernel with tcx answers ENODEV, one without it
// does not know the attach type.
func probeTCX() (has bool, loadErr, attachErr error) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		return false, fmt.Errorf("probe tc programs: %w", err), nil
	}
	defer prog.Close()
	l, err := link.AttachTCX(link.TCXOptions{Interface: 0, Program: prog, Attach: ebpf.AttachTCXIngress})
	switch {
	case err == nil:
		l.Close()
		return true, nil, nil
	case errors.Is(err, unix.ENODEV):
		return true, nil, nil
	case errors.Is(err, ebpf.ErrNotSupported):
		return false, nil, nil
	}
	return false, nil, fmt.Errorf("tcx probe failed: %w", err)
}

// NewHook returns the hook of a mode.
func NewHook(mode string, opts Options) (Hook, error) {
	switch mode {
	case ModeTCX:
		return newTCX(opts), nil
	case ModeTC:
		return newClsact(opts)
	}
	return nil, fmt.Errorf("attach mode %q: must be %s or %s", mode, ModeTCX, ModeTC)
}

// Manager attaches with one hook and keeps the other's attachments off the same devices.
type Manager struct {
	attach, other Hook
	// The two hooks by type, for what only one of them has (link pins, filters, netlink).
	tcx  *tcx
	cls  *clsact
	opts Options
	log  *slog.Logger
}

// NewManager returns a manager that attaches in mode.
func NewManager(mode string, opts Options) (*Manager, error) {
	if mode != ModeTCX && mode != ModeTC {
		return nil, fmt.Errorf("attach mode %q: must be %s or %s", mode, ModeTCX, ModeTC)
	}
	c, err := newClsact(opts)
	if err != nil {
		return nil, err
	}
	m := &Manager{tcx: newTCX(opts), cls: c, opts: opts, log: opts.logger()}
	m.attach, m.other = m.tcx, m.cls
	if mode == ModeTC {
		m.attach, m.other = m.cls, m.tcx
	}
	return m, nil
}

func (m *Manager) owns(info *ebpf.ProgramInfo) bool { return m.opts.Owns != nil && m.opts.Owns(info) }

// Mode is the mode the manager attaches in.
func (m *Manager) Mode() string { return m.attach.Mode() }

// Attach makes the device run both programs, then removes what of ours the other mode left
// there (after, so that the device is never without them).
func (m *Manager) Attach(ctx context.Context, ifindex int, progs Programs) error {
	for _, d := range Directions() {
		if err := m.attach.Attach(ctx, ifindex, d, progs.get(d)); err != nil {
			return err
		}
	}
	for _, d := range Directions() {
		if err := m.other.Detach(ctx, ifindex, d); err != nil {
			return fmt.Errorf("remove %s attachment of ifindex %d: %w", m.other.Mode(), ifindex, err)
		}
	}
	return nil
}

// Status is what Manager.Check finds on a device.
type Status struct {
	// Runs: both hooks run the programs through our attachments of the manager's mode.
	Runs bool
	// Pinned: every attachment that needs a pin to outlive the process (tcx links) has it.
	// Attach pins a link again whose pin went missing.
	Pinned bool
}

// Check tells whether the device runs both programs through attachments of the manager's mode
// and whether their pins are in place, at the cost of a query per hook. A device that is gone
// fails with an error wrapping ErrNoDevice.
func (m *Manager) Check(ctx context.Context, ifindex int, progs Programs) (Status, error) {
	st := Status{Runs: true, Pinned: true}
	for _, d := range Directions() {
		ok, err := m.attach.Runs(ctx, ifindex, d, progs.get(d))
		if err != nil {
			return Status{}, err
		}
		st.Runs = st.Runs && ok
		if m.attach == m.tcx && !m.tcx.hasPin(slot{ifindex, d}) {
			st.Pinned = false
		}
	}
	return st, nil
}

// Detach removes ours, of both modes, from the device.
func (m *Manager) Detach(ctx context.Context, ifindex int) error {
	var errs []error
	for _, h := range []Hook{m.attach, m.other} {
		for _, d := range Directions() {
			errs = append(errs, h.Detach(ctx, ifindex, d))
		}
	}
	return errors.Join(errs...)
}

// List returns ours, of both modes, on every device.
func (m *Manager) List(ctx context.Context) ([]Attachment, error) {
	a, err := m.attach.List(ctx)
	if err != nil {
		return nil, err
	}
	o, err := m.other.List(ctx)
	if err != nil {
		return nil, err
	}
	return append(a, o...), nil
}

// Pinned returns the devices that have a tcx link pin (attached or not any more), without
// looking at any device: cheap enough for every apply, unlike List.
func (m *Manager) Pinned() ([]int, error) { return m.tcx.pinned() }

// DevicePackets returns how many packets the device has received and sent, as its counters
// say: what its ingress and egress hooks must have seen (give or take what XDP or an AF_PACKET
// socket bypassing the qdisc moved).
func (m *Manager) DevicePackets(ctx context.Context, ifindex int) (in, out uint64, err error) {
	if err := ctx.Err(); err != nil {
		return 0, 0, err
	}
	m.cls.mu.Lock()
	l, err := m.cls.nl.LinkByIndex(ifindex)
	m.cls.mu.Unlock()
	if isNoDevice(err) {
		return 0, 0, fmt.Errorf("ifindex %d: %w", ifindex, ErrNoDevice)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("read counters of ifindex %d: %w", ifindex, err)
	}
	st := l.Attrs().Statistics
	if st == nil {
		return 0, 0, fmt.Errorf("ifindex %d reports no counters", ifindex)
	}
	return st.RxPackets, st.TxPackets, nil
}

// Close releases both hooks; attachments stay.
func (m *Manager) Close() error {
	return errors.Join(m.attach.Close(), m.other.Close())
}

// RemoveAll removes ours, of both modes, from every device, and the link pins: what a cleanup
// needs, from any process. It returns what it removed.
func RemoveAll(ctx context.Context, opts Options) ([]Attachment, error) {
	var removed []Attachment
	var errs []error
	for _, mode := range []string{ModeTCX, ModeTC} {
		h, err := NewHook(mode, opts)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		found, err := h.List(ctx)
		if err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
			errs = append(errs, fmt.Errorf("list %s attachments: %w", mode, err))
		}
		for _, a := range found {
			if err := h.Detach(ctx, a.Ifindex, a.Dir); err != nil {
				errs = append(errs, err)
				continue
			}
			removed = append(removed, a)
		}
		if t, ok := h.(*tcx); ok {
			errs = append(errs, t.removePins())
		}
		errs = append(errs, h.Close())
	}
	return removed, errors.Join(errs...)
}
