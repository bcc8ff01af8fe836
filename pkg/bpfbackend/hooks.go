package bpfbackend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// Neighbours on the uplinks' hooks.
//
// Our programs let the chain go on, so a program behind ours sees every packet. A program ahead
// of ours decides whether ours runs: if it ends the chain, the packets it passes leave
// unmasqueraded (egress) or reach the stack untranslated (ingress), and nothing of ours is
// damaged for the usual drift checks to see. So each check also samples every hook: the
// device's packet counter and the time our program last ran there (bpf.Datapath.HookSeen). A
// hook with a program ahead of ours whose device moved packets between two samples while ours
// ran on none of them is bypassed. Only the whole chain being ended is seen this way: a program
// ahead that passes some packets and ends the chain for others cannot be told from traffic that
// simply varies, and is reported as ahead only.

// hookKey identifies a hook.
type hookKey struct {
	ifindex int
	dir     tc.Direction
}

// hookSample is one reading of a hook.
type hookSample struct {
	at      time.Duration // bpf.MonotonicNow when read
	packets uint64        // the device's counter of the direction
	seen    time.Duration // when our program last ran there
}

// bypassedBetween tells whether the device moved packets between the samples while our program
// ran on none of them: its stamp, which lags by at most bpf.HookRefresh, is older than the first
// sample by more than that lag plus as much again for packets in flight between the hook and the
// device's counter.
func bypassedBetween(prev, cur hookSample) bool {
	return cur.packets > prev.packets && cur.seen+2*bpf.HookRefresh < prev.at
}

// stillBypassed is the state of a hook with a program ahead of ours after a new sample: bypassed
// on evidence, no longer once our program ran again, and as it was while the device is idle.
func stillBypassed(was bool, prev, cur hookSample) bool {
	switch {
	case bypassedBetween(prev, cur):
		return true
	case cur.seen != prev.seen:
		return false
	}
	return was
}

// hookState is what the checks know of a hook.
type hookState struct {
	device     string
	sample     hookSample
	ahead      []tc.Neighbour
	behind     []tc.Neighbour
	bypassed   bool
	bypasses   uint64
	neighbours string // the neighbours as last logged
}

func (h *hookState) report(k hookKey) datapath.Hook {
	return datapath.Hook{Device: h.device, Ifindex: k.ifindex, Direction: k.dir.String(),
		Ahead: names(h.ahead), Behind: names(h.behind), Bypassed: h.bypassed, Bypasses: h.bypasses}
}

func names(ns []tc.Neighbour) []string {
	var out []string
	for _, n := range ns {
		out = append(out, n.String())
	}
	return out
}

func bpfDir(d tc.Direction) bpf.Direction {
	if d == tc.Ingress {
		return bpf.Ingress
	}
	return bpf.Egress
}

// sampleHooks reads the neighbours and a sample of both hooks of a device.
func sampleHooks(ctx context.Context, attach *tc.Manager, dp *bpf.Datapath, ifindex int) ([]tc.Neighbour, map[tc.Direction]hookSample, error) {
	ns, err := attach.Neighbours(ctx, ifindex)
	if err != nil {
		return nil, nil, err
	}
	at := bpf.MonotonicNow()
	in, out, err := attach.DevicePackets(ctx, ifindex)
	if err != nil {
		return nil, nil, err
	}
	samples := map[tc.Direction]hookSample{}
	for _, d := range tc.Directions() {
		seen, err := dp.HookSeen(ifindex, bpfDir(d))
		if err != nil {
			return nil, nil, err
		}
		s := hookSample{at: at, packets: out, seen: seen}
		if d == tc.Ingress {
			s.packets = in
		}
		samples[d] = s
	}
	return ns, samples, nil
}

// split divides a device's neighbours of one direction into those ahead of ours and behind.
func split(ns []tc.Neighbour, d tc.Direction) (ahead, behind []tc.Neighbour) {
	for _, n := range ns {
		switch {
		case n.Dir != d:
		case n.Ahead:
			ahead = append(ahead, n)
		default:
			behind = append(behind, n)
		}
	}
	return ahead, behind
}

// checkHooks samples every uplink's hooks, logs what changed (neighbours, once per change; a
// bypass when it starts and when it ends), and tells whether a hook is bypassed. Uplinks that
// are gone are skipped, and hooks of devices that are no longer uplinks forgotten.
func (b *Backend) checkHooks(ctx context.Context, dp *bpf.Datapath, ups []uplink.Uplink) (bool, error) {
	b.hookMu.Lock()
	defer b.hookMu.Unlock()
	if b.hooks == nil {
		b.hooks = map[hookKey]*hookState{}
	}
	live := map[hookKey]bool{}
	bypassed := false
	for _, u := range ups {
		ns, samples, err := sampleHooks(ctx, b.attach, dp, u.Index)
		if errors.Is(err, tc.ErrNoDevice) {
			continue
		}
		if err != nil {
			return false, err
		}
		for _, d := range tc.Directions() {
			k := hookKey{u.Index, d}
			live[k] = true
			h, known := b.hooks[k]
			if !known {
				h = &hookState{}
				b.hooks[k] = h
			}
			h.device = u.Name
			h.ahead, h.behind = split(ns, d)
			cur := samples[d]
			b.logHook(k, h, known && len(h.ahead) > 0 && stillBypassed(h.bypassed, h.sample, cur))
			h.sample = cur
			bypassed = bypassed || h.bypassed
		}
	}
	for k := range b.hooks {
		if !live[k] {
			delete(b.hooks, k)
		}
	}
	return bypassed, nil
}

// logHook records a hook's new bypass state and logs the changes.
func (b *Backend) logHook(k hookKey, h *hookState, bypassed bool) {
	log := b.log.With("uplink", h.device, "direction", k.dir.String())
	if s := fmt.Sprint(names(h.ahead), names(h.behind)); s != h.neighbours {
		if len(h.ahead)+len(h.behind) > 0 || h.neighbours != "" {
			log.Info("programs of other components share the uplink's hook", "ahead", names(h.ahead), "behind", names(h.behind))
		}
		h.neighbours = s
	}
	switch {
	case bypassed && !h.bypassed:
		h.bypasses++
		log.Warn("a program ahead of ours ends the chain: ours saw none of the device's packets, the policy is not enforced on this hook",
			"ahead", names(h.ahead))
	case !bypassed && h.bypassed:
		log.Info("our program sees the device's packets again: the policy is enforced on this hook")
	}
	h.bypassed = bypassed
}

// Hooks implements datapath.HookReporter: what the last drift check found.
func (b *Backend) Hooks(ctx context.Context) ([]datapath.Hook, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.hookMu.Lock()
	defer b.hookMu.Unlock()
	out := make([]datapath.Hook, 0, len(b.hooks))
	for k, h := range b.hooks {
		out = append(out, h.report(k))
	}
	sortHooks(out)
	return out, nil
}

func sortHooks(hs []datapath.Hook) {
	slices.SortFunc(hs, func(a, b datapath.Hook) int {
		if c := strings.Compare(a.Device, b.Device); c != 0 {
			return c
		}
		if a.Ifindex != b.Ifindex {
			return a.Ifindex - b.Ifindex
		}
		return strings.Compare(a.Direction, b.Direction) // egress < ingress
	})
}

// readerPause is how long Installed.Hooks waits between its two samples of a hook with a program
// ahead of ours: longer than the stamp's lag twice, so that a program of ours that runs is seen
// running.
const readerPause = 3 * bpf.HookRefresh

// readHooks is Installed.Hooks: a sample of each uplink's hooks, and where a program runs ahead of
// ours a second one readerPause later, to tell whether ours is bypassed.
func readHooks(ctx context.Context, dp *bpf.Datapath, mode, pinDir string, ups []uplink.Uplink) ([]datapath.Hook, error) {
	m, err := tc.NewManager(mode, tcOptions(pinDir, slog.New(slog.DiscardHandler)))
	if err != nil {
		return nil, err
	}
	defer m.Close()
	type first struct {
		k      hookKey
		h      *hookState
		sample hookSample
	}
	var firsts []first
	for _, u := range ups {
		ns, samples, err := sampleHooks(ctx, m, dp, u.Index)
		if errors.Is(err, tc.ErrNoDevice) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, d := range tc.Directions() {
			h := &hookState{device: u.Name}
			h.ahead, h.behind = split(ns, d)
			firsts = append(firsts, first{hookKey{u.Index, d}, h, samples[d]})
		}
	}
	if slices.ContainsFunc(firsts, func(f first) bool { return len(f.h.ahead) > 0 }) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(readerPause):
		}
	}
	out := make([]datapath.Hook, 0, len(firsts))
	for _, f := range firsts {
		if len(f.h.ahead) > 0 {
			_, samples, err := sampleHooks(ctx, m, dp, f.k.ifindex)
			if err != nil && !errors.Is(err, tc.ErrNoDevice) {
				return nil, err
			}
			f.h.bypassed = err == nil && bypassedBetween(f.sample, samples[f.k.dir])
		}
		out = append(out, f.h.report(f.k))
	}
	sortHooks(out)
	return out, nil
}
