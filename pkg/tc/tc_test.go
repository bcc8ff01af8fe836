package tc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Every test works in a network namespace of its own, on a veth pair it creates there, and pins
// in a bpffs it mounts in a temporary directory.

type sandbox struct {
	ns     string
	a, b   int // ifindexes of the veth pair
	opts   Options
	progs  Programs // "ours"
	progs2 Programs // ours, a newer version
}

func newSandbox(t *testing.T) *sandbox {
	t.Helper()
	testutil.RequirePrivileged(t, "ip")
	sb := &sandbox{ns: testutil.NewNetns(t)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "ip", "-n", sb.ns, "link", "add", "va", "type", "veth", "peer", "name", "vb").CombinedOutput(); err != nil {
		t.Fatalf("ip link add: %v: %s", err, out)
	}
	testutil.InNetns(t, sb.ns, func() {
		for name, idx := range map[string]*int{"va": &sb.a, "vb": &sb.b} {
			ifc, err := net.InterfaceByName(name)
			if err != nil {
				t.Fatal(err)
			}
			*idx = ifc.Index
		}
	})
	bpffs := testutil.MountBPFFS(t)
	sb.opts = Options{
		LinkDir: filepath.Join(bpffs, "links"), FilterName: "tc-test", FilterPriority: 20000, FilterHandle: 1,
		Owns: func(info *ebpf.ProgramInfo) bool { return info.Name == "t_egress" || info.Name == "t_ingress" },
	}
	sb.progs = Programs{Egress: newProg(t, "t_egress", 0), Ingress: newProg(t, "t_ingress", 0)}
	sb.progs2 = Programs{Egress: newProg(t, "t_egress", 1), Ingress: newProg(t, "t_ingress", 1)}
	return sb
}

// newProg returns a program that passes every packet; v makes versions differ.
func newProg(t *testing.T, name string, v int32) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R1, v), asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func id(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	i, err := progID(p)
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// tcxProgs lists the programs attached by tcx at a device and direction.
func tcxProgs(t *testing.T, ifindex int, d Direction) []ebpf.ProgramID {
	t.Helper()
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: attachType(d)})
	if err != nil {
		t.Fatal(err)
	}
	var out []ebpf.ProgramID
	for _, p := range res.Programs {
		out = append(out, p.ID)
	}
	return out
}

// filters lists the bpf filters of a device and direction as "prio/handle name id".
func filters(t *testing.T, ifindex int, d Direction) []string {
	t.Helper()
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := netlink.FilterList(l, parent(d))
	if errors.Is(err, unix.EINVAL) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range fs {
		bf := f.(*netlink.BpfFilter)
		out = append(out, fmt.Sprintf("%d/%d %s %d", bf.Priority, bf.Handle, bf.Name, bf.Id))
	}
	return out
}

func hasClsact(t *testing.T, ifindex int) bool {
	t.Helper()
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		t.Fatal(err)
	}
	qs, err := netlink.QdiscList(l)
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(qs, func(q netlink.Qdisc) bool { return q.Type() == "clsact" })
}

func TestProbe(t *testing.T) {
	testutil.RequirePrivileged(t)
	mode, reason, err := Probe()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("probe: %s (%s)", mode, reason)
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		t.Fatal(err)
	}
	// This only checks the probe against the kernel it runs on; the probe itself never looks
	// at the version.
	var major, minor int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(uts.Release[:]), "%d.%d", &major, &minor); err != nil {
		t.Fatalf("kernel release: %v", err)
	}
	if want := major > 6 || major == 6 && minor >= 6; (mode == ModeTCX) != want {
		t.Errorf("probe says %s on Linux %d.%d", mode, major, minor)
	}
}

// TestTCX: attach pins links; a second attach with the same programs changes nothing; a new
// hook (a restarted process) replaces the programs through the pinned links, in place; others'
// programs stay; detach removes ours and the pins.
func TestTCX(t *testing.T) {
	sb := newSandbox(t)
	requireTCX(t)
	ctx := context.Background()
	testutil.InNetns(t, sb.ns, func() {
		foreign := newProg(t, "foreign", 7)
		fl, err := link.AttachTCX(link.TCXOptions{Interface: sb.a, Program: foreign, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			t.Fatal(err)
		}
		defer fl.Close()

		h := newTCX(sb.opts)
		for _, d := range Directions() {
			if err := h.Attach(ctx, sb.a, d, sb.progs.get(d)); err != nil {
				t.Fatal(err)
			}
		}
		// Egress: ours goes at the head, ahead of the program that was there first.
		if got := tcxProgs(t, sb.a, Egress); !slices.Equal(got, []ebpf.ProgramID{id(t, sb.progs.Egress), id(t, foreign)}) {
			t.Fatalf("egress programs %v, want ours first", got)
		}
		lnk, err := link.LoadPinnedLink(filepath.Join(sb.opts.LinkDir, fmt.Sprintf("%d-egress", sb.a)), nil)
		if err != nil {
			t.Fatalf("egress link not pinned: %v", err)
		}
		info, err := lnk.Info()
		lnk.Close()
		if err != nil {
			t.Fatal(err)
		}
		linkID := info.ID
		// Again: nothing changes.
		if err := h.Attach(ctx, sb.a, Egress, sb.progs.Egress); err != nil {
			t.Fatal(err)
		}
		h.Close()

		// A restarted process: the pinned link gets the new program; same link, no gap.
		h2 := newTCX(sb.opts)
		defer h2.Close()
		for _, d := range Directions() {
			if err := h2.Attach(ctx, sb.a, d, sb.progs2.get(d)); err != nil {
				t.Fatal(err)
			}
		}
		res, err := link.QueryPrograms(link.QueryOptions{Target: sb.a, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Programs) != 2 || res.Programs[0].ID != id(t, sb.progs2.Egress) {
			t.Fatalf("after the restart: %+v", res.Programs)
		}
		if lid, _ := res.Programs[0].LinkID(); lid != linkID {
			t.Fatalf("the restart made link %d, want the pinned link %d updated", lid, linkID)
		}
		got, err := h2.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 2 {
			t.Fatalf("list: %+v, want ours at egress and ingress only", got)
		}

		// Someone detaches ours: the next attach makes a new link.
		if err := detachID(linkID); err != nil {
			t.Fatal(err)
		}
		if got := tcxProgs(t, sb.a, Egress); !slices.Equal(got, []ebpf.ProgramID{id(t, foreign)}) {
			t.Fatalf("after the detach: %v", got)
		}
		if err := h2.Attach(ctx, sb.a, Egress, sb.progs2.Egress); err != nil {
			t.Fatal(err)
		}
		if got := tcxProgs(t, sb.a, Egress); !slices.Equal(got, []ebpf.ProgramID{id(t, sb.progs2.Egress), id(t, foreign)}) {
			t.Fatalf("after the repair: %v", got)
		}

		// Ours attached without a pin here (another bpffs) is found and replaced.
		stray, err := link.AttachTCX(link.TCXOptions{Interface: sb.b, Program: sb.progs.Ingress, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			t.Fatal(err)
		}
		defer stray.Close()
		if err := h2.Attach(ctx, sb.b, Ingress, sb.progs2.Ingress); err != nil {
			t.Fatal(err)
		}
		if got := tcxProgs(t, sb.b, Ingress); !slices.Equal(got, []ebpf.ProgramID{id(t, sb.progs2.Ingress)}) {
			t.Fatalf("vb ingress: %v, want only the new attachment", got)
		}

		for _, d := range Directions() {
			for range 2 { // twice: absent is fine
				if err := h2.Detach(ctx, sb.a, d); err != nil {
					t.Fatal(err)
				}
			}
		}
		if got := tcxProgs(t, sb.a, Egress); !slices.Equal(got, []ebpf.ProgramID{id(t, foreign)}) {
			t.Fatalf("after detach: %v, want only the foreign program", got)
		}
		removed, err := RemoveAll(ctx, sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		if len(removed) != 1 || removed[0].Ifindex != sb.b {
			t.Fatalf("RemoveAll removed %+v, want vb's ingress", removed)
		}
		if _, err := os.Stat(sb.opts.LinkDir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("link pins left: %v", err)
		}
		if got := tcxProgs(t, sb.b, Ingress); len(got) != 0 {
			t.Fatalf("vb ingress after RemoveAll: %v", got)
		}
	})
}

// TestClsact: attach adds clsact and our filters; a second hook replaces the programs in place;
// others' filters stay; detach removes ours and the qdisc once it is empty.
func TestClsact(t *testing.T) {
	sb := newSandbox(t)
	ctx := context.Background()
	testutil.InNetns(t, sb.ns, func() {
		h, err := newClsact(sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range Directions() {
			if err := h.Attach(ctx, sb.a, d, sb.progs.get(d)); err != nil {
				t.Fatal(err)
			}
		}
		want := fmt.Sprintf("20000/1 tc-test:t_egress %d", id(t, sb.progs.Egress))
		if got := filters(t, sb.a, Egress); !slices.Equal(got, []string{want}) {
			t.Fatalf("egress filters %v, want %v", got, want)
		}
		h.Close()

		// Another tool's filter on the same device.
		foreign := newProg(t, "foreign", 3)
		ff := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: sb.a, Parent: netlink.HANDLE_MIN_EGRESS,
			Handle: 1, Priority: 1, Protocol: unix.ETH_P_ALL}, Fd: foreign.FD(), Name: "foreign", DirectAction: true}
		if err := netlink.FilterAdd(ff); err != nil {
			t.Fatal(err)
		}

		h2, err := newClsact(sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer h2.Close()
		for _, d := range Directions() {
			if err := h2.Attach(ctx, sb.a, d, sb.progs2.get(d)); err != nil {
				t.Fatal(err)
			}
		}
		want2 := []string{fmt.Sprintf("1/1 foreign %d", id(t, foreign)), fmt.Sprintf("20000/1 tc-test:t_egress %d", id(t, sb.progs2.Egress))}
		if got := filters(t, sb.a, Egress); !slices.Equal(got, want2) {
			t.Fatalf("after the restart: %v, want %v", got, want2)
		}
		got, err := h2.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 2 || got[0].Program != id(t, sb.progs2.Egress) {
			t.Fatalf("list %+v", got)
		}
		for _, d := range Directions() {
			if err := h2.Detach(ctx, sb.a, d); err != nil {
				t.Fatal(err)
			}
		}
		if got := filters(t, sb.a, Egress); !slices.Equal(got, want2[:1]) {
			t.Fatalf("after detach: %v, want the foreign filter only", got)
		}
		if !hasClsact(t, sb.a) {
			t.Fatal("the clsact qdisc holding another filter was removed")
		}
		if err := netlink.FilterDel(ff); err != nil {
			t.Fatal(err)
		}
		// Ours once more, then detach: the qdisc goes with the last filter.
		if err := h2.Attach(ctx, sb.a, Ingress, sb.progs2.Ingress); err != nil {
			t.Fatal(err)
		}
		if err := h2.Detach(ctx, sb.a, Ingress); err != nil {
			t.Fatal(err)
		}
		if hasClsact(t, sb.a) {
			t.Fatal("an empty clsact qdisc was left")
		}
		// A filter not ours at our priority and handle is an error, not a replacement.
		ff.Priority = 20000
		if err := h2.ensureQdisc(sb.a); err != nil {
			t.Fatal(err)
		}
		if err := netlink.FilterAdd(ff); err != nil {
			t.Fatal(err)
		}
		if err := h2.Attach(ctx, sb.a, Egress, sb.progs2.Egress); err == nil {
			t.Fatal("attach replaced another tool's filter")
		}
	})
}

// TestManagerSwitchesModes: attaching in one mode removes what the other left on the device.
func TestManagerSwitchesModes(t *testing.T) {
	sb := newSandbox(t)
	requireTCX(t)
	ctx := context.Background()
	testutil.InNetns(t, sb.ns, func() {
		tcm, err := NewManager(ModeTC, sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer tcm.Close()
		if err := tcm.Attach(ctx, sb.a, sb.progs); err != nil {
			t.Fatal(err)
		}
		xm, err := NewManager(ModeTCX, sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer xm.Close()
		if err := xm.Attach(ctx, sb.a, sb.progs2); err != nil {
			t.Fatal(err)
		}
		if got := filters(t, sb.a, Egress); len(got) != 0 {
			t.Fatalf("tc filters left after switching to tcx: %v", got)
		}
		if got := tcxProgs(t, sb.a, Ingress); !slices.Equal(got, []ebpf.ProgramID{id(t, sb.progs2.Ingress)}) {
			t.Fatalf("tcx ingress %v", got)
		}
		// And back.
		if err := tcm.Attach(ctx, sb.a, sb.progs); err != nil {
			t.Fatal(err)
		}
		if got := tcxProgs(t, sb.a, Egress); len(got) != 0 {
			t.Fatalf("tcx programs left after switching to tc: %v", got)
		}
		all, err := tcm.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(all) != 2 || all[0].Mode != ModeTC {
			t.Fatalf("list %+v", all)
		}
		if err := tcm.Detach(ctx, sb.a); err != nil {
			t.Fatal(err)
		}
		if all, err := tcm.List(ctx); err != nil || len(all) != 0 {
			t.Fatalf("after detach: %+v %v", all, err)
		}
	})
}

// TestManagerCheck: Check sees a program detached by hand and a tcx link pin removed; Attach
// repairs both, and the link pinned again outlives the manager; a device that is gone is
// ErrNoDevice.
func TestManagerCheck(t *testing.T) {
	for _, mode := range []string{ModeTCX, ModeTC} {
		t.Run(mode, func(t *testing.T) {
			sb := newSandbox(t)
			if mode == ModeTCX {
				requireTCX(t)
			}
			ctx := context.Background()
			testutil.InNetns(t, sb.ns, func() {
				m, err := NewManager(mode, sb.opts)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { m.Close() }()
				check := func(want Status) {
					t.Helper()
					got, err := m.Check(ctx, sb.a, sb.progs)
					if err != nil || got != want {
						t.Fatalf("check: %+v %v, want %+v", got, err, want)
					}
				}
				if err := m.Attach(ctx, sb.a, sb.progs); err != nil {
					t.Fatal(err)
				}
				check(Status{Runs: true, Pinned: true})
				if got, err := m.Check(ctx, sb.a, sb.progs2); err != nil || got.Runs {
					t.Fatalf("check with other programs: %+v %v", got, err)
				}

				// The egress program detached by hand.
				if mode == ModeTCX {
					res, err := link.QueryPrograms(link.QueryOptions{Target: sb.a, Attach: ebpf.AttachTCXEgress})
					if err != nil || len(res.Programs) != 1 {
						t.Fatalf("query: %+v %v", res, err)
					}
					lid, _ := res.Programs[0].LinkID()
					if err := detachID(lid); err != nil {
						t.Fatal(err)
					}
				} else {
					l, err := netlink.LinkByIndex(sb.a)
					if err != nil {
						t.Fatal(err)
					}
					fs, err := netlink.FilterList(l, parent(Egress))
					if err != nil || len(fs) != 1 {
						t.Fatalf("filters: %v %v", fs, err)
					}
					if err := netlink.FilterDel(fs[0]); err != nil {
						t.Fatal(err)
					}
				}
				check(Status{Runs: false, Pinned: true})
				if err := m.Attach(ctx, sb.a, sb.progs); err != nil {
					t.Fatal(err)
				}
				check(Status{Runs: true, Pinned: true})

				if mode == ModeTCX {
					// A link pin removed by hand: the link would go with the process.
					pin := filepath.Join(sb.opts.LinkDir, fmt.Sprintf("%d-ingress", sb.a))
					if err := os.Remove(pin); err != nil {
						t.Fatal(err)
					}
					check(Status{Runs: true, Pinned: false})
					if err := m.Attach(ctx, sb.a, sb.progs); err != nil {
						t.Fatal(err)
					}
					check(Status{Runs: true, Pinned: true})
					m.Close()
					if got := tcxProgs(t, sb.a, Ingress); !slices.Equal(got, []ebpf.ProgramID{id(t, sb.progs.Ingress)}) {
						t.Fatalf("after the manager closed, ingress runs %v: the pin did not keep the link", got)
					}
					if m, err = NewManager(mode, sb.opts); err != nil {
						t.Fatal(err)
					}
					check(Status{Runs: true, Pinned: true})
				}

				if out, err := exec.Command("ip", "-n", sb.ns, "link", "del", "va").CombinedOutput(); err != nil {
					t.Fatalf("ip link del: %v: %s", err, out)
				}
				if _, err := m.Check(ctx, sb.a, sb.progs); !errors.Is(err, ErrNoDevice) {
					t.Fatalf("check of a deleted device: %v, want ErrNoDevice", err)
				}
			})
		})
	}
}

// requireTCX stops a test that needs tcx on a kernel without it (before 6.6): a skip outside CI,
// a failure in CI. A failing probe is always a failure.
func requireTCX(t *testing.T) {
	t.Helper()
	has, err := HaveTCX()
	if err != nil {
		t.Fatalf("probe: %v", err)
	}
	if !has {
		testutil.NotOnThisKernel(t, "tcx links")
	}
}

// An empty clsact qdisc that our detach did not empty belongs to someone else: it stays.
func TestClsactDetachLeavesForeignQdisc(t *testing.T) {
	sb := newSandbox(t)
	ctx := context.Background()
	testutil.InNetns(t, sb.ns, func() {
		q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: sb.b, Handle: netlink.MakeHandle(0xffff, 0),
			Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
		if err := netlink.QdiscAdd(q); err != nil {
			t.Fatal(err)
		}
		h, err := newClsact(sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		for _, d := range Directions() {
			if err := h.Detach(ctx, sb.b, d); err != nil {
				t.Fatal(err)
			}
		}
		lnk, err := netlink.LinkByIndex(sb.b)
		if err != nil {
			t.Fatal(err)
		}
		qs, err := netlink.QdiscList(lnk)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(qs, func(q netlink.Qdisc) bool { return q.Type() == "clsact" }) {
			t.Errorf("the foreign clsact qdisc was deleted: %v", qs)
		}
	})
}
