package bpfbackend

import (
	"context"
	"flag"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// Entry is the BPF datapath as the registry lists it: tc programs on the uplinks, maps pinned
// under --bpffs.
var Entry = datapath.Entry{
	Name:       Name,
	Title:      "BPF",
	AutoWhen:   "when the kernel supports it",
	Installs:   "the BPF programs and pins",
	DriftKinds: driftKinds,
	Flags:      func(fs *flag.FlagSet) datapath.Settings { return registerFlags(fs) },
	New: func(ctx context.Context, e datapath.Env) (datapath.Backend, error) {
		return New(ctx, settingsOf(e).options(e))
	},
	Cleanup: func(ctx context.Context, e datapath.Env) (string, error) {
		bpffs := settingsOf(e).BPFFS
		removed, err := Cleanup(ctx, bpffs, e.Logger)
		if err != nil {
			return "", err
		}
		report := fmt.Sprintf("%d program attachments removed (tcx links and tc filters on every device)", len(removed.Attachments))
		if removed.BPFDenied != nil {
			report += fmt.Sprintf(", %d tcx link pins removed, which detaches (shortly after) each link that no process holds open, unchecked: %v;",
				removed.UnpinnedLinks, removed.BPFDenied)
		}
		if removed.PinDir != "" {
			return report + fmt.Sprintf(", pins under %s removed", removed.PinDir), nil
		}
		return report + fmt.Sprintf(", nothing pinned under %s", filepath.Join(bpffs, PinDir)), nil
	},
	Read: func(_ context.Context, e datapath.Env, p *policy.Policy) ([]datapath.Reader, error) {
		// Opens the pinned maps read-only: no program loaded, no map created.
		r, err := Inspect(settingsOf(e).BPFFS, e.Interfaces, p)
		if err != nil || r == nil {
			return nil, err
		}
		return []datapath.Reader{r}, nil
	},
	Absent: func(e datapath.Env) string {
		return "nothing pinned under " + filepath.Join(settingsOf(e).BPFFS, PinDir)
	},
}

// Settings are the BPF backend's flags.
type Settings struct {
	// BPFFS is --bpffs, AttachMode --attach-mode, SweepInterval --nat-sweep-interval.
	BPFFS         string
	AttachMode    string
	SweepInterval time.Duration
	// NATEntries is --nat-max-entries.
	NATEntries uint
	// NATTimeouts is --nat-timeouts, which Check parses into Timeouts.
	NATTimeouts string
	Timeouts    bpf.Timeouts
	// ReplaceNewer is --replace-newer-layout.
	ReplaceNewer bool
}

// DefaultBPFFS is the default --bpffs: where the node mounts its BPF filesystem.
const DefaultBPFFS = "/sys/fs/bpf"

// Bounds of --nat-max-entries: below the minimum a node runs out of room at once; the maximum
// is about 4 GiB of kernel memory per family.
const (
	minNATEntries = 1024
	maxNATEntries = 1 << 24
)

func registerFlags(fs *flag.FlagSet) *Settings {
	s := &Settings{}
	fs.StringVar(&s.BPFFS, "bpffs", DefaultBPFFS, "BPF filesystem where maps and links are pinned")
	fs.StringVar(&s.AttachMode, "attach-mode", tc.ModeAuto, "how the BPF backend attaches its programs: auto (tcx where the kernel has it, else tc), tcx, or tc (clsact and cls_bpf)")
	fs.DurationVar(&s.SweepInterval, "nat-sweep-interval", DefaultSweepInterval, "how often the BPF backend removes idle NAT entries")
	fs.UintVar(&s.NATEntries, "nat-max-entries", bpf.DefaultNATEntries, natMaxEntriesUsage())
	fs.StringVar(&s.NATTimeouts, "nat-timeouts", "", `idle timeouts of BPF NAT entries, e.g. "udp=30s,tcp-closing=10s" (keys: `+strings.Join(timeoutKeys(), ", ")+"); "+
		"each one not given is the node's own conntrack sysctl where the nf_conntrack module is loaded, else conntrack's default")
	fs.BoolVar(&s.ReplaceNewer, "replace-newer-layout", false, "the way back from a rollback: take over the BPF datapath of a newer agent (pinned maps of a newer layout), "+
		"which this agent otherwise refuses and leaves alone; its programs are replaced in place and its maps removed, and the flows they held are lost")
	return s
}

func natMaxEntriesUsage() string {
	mib := func(n uint32, v6 bool) string { return fmt.Sprintf("%.0f MiB", float64(bpf.NATMemory(n, v6))/(1<<20)) }
	return fmt.Sprintf("entries of each family's BPF table of flows that proved two-way, never evicted (two per flow), "+
		"from %d to %d; flows not yet answered get half as many (evicted first), kept RETURN verdicts a quarter and "+
		"connections from outside waiting for a reply a sixteenth. "+
		"Preallocated kernel memory per family, %.0f bytes per entry for IPv4 and %.0f for IPv6: %s and %s at the default "+
		"(IPv6 only with --enable-ipv6); a change carries the flows into tables of the new size", minNATEntries, maxNATEntries,
		float64(bpf.NATMemory(1<<20, false))/(1<<20), float64(bpf.NATMemory(1<<20, true))/(1<<20),
		mib(bpf.DefaultNATEntries, false), mib(bpf.DefaultNATEntries, true))
}

// Check implements datapath.Settings, and parses --nat-timeouts.
func (s *Settings) Check() error {
	if err := tc.CheckMode(s.AttachMode); err != nil {
		return err
	}
	if s.SweepInterval <= 0 {
		return fmt.Errorf("nat-sweep-interval %v: must be positive", s.SweepInterval)
	}
	timeouts, err := parseTimeouts(s.NATTimeouts)
	if err != nil {
		return err
	}
	s.Timeouts = timeouts
	if s.NATEntries < minNATEntries || s.NATEntries > maxNATEntries {
		return fmt.Errorf("nat-max-entries %d: must be from %d to %d", s.NATEntries, minNATEntries, maxNATEntries)
	}
	return nil
}

// options are the backend's Options under e.
func (s *Settings) options(e datapath.Env) Options {
	return Options{BPFFS: s.BPFFS, Interfaces: e.Interfaces, AttachMode: s.AttachMode,
		SweepInterval: s.SweepInterval, Timeouts: s.Timeouts, NATEntries: uint32(s.NATEntries), ReplaceNewer: s.ReplaceNewer, Logger: e.Logger}
}

// settingsOf are e's settings of this backend; none are the defaults.
func settingsOf(e datapath.Env) *Settings {
	if s, ok := e.Own.(*Settings); ok {
		return s
	}
	return registerFlags(flag.NewFlagSet("", flag.ContinueOnError))
}

// timeoutFields are the keys of --nat-timeouts and the timeout each sets.
func timeoutFields(t *bpf.Timeouts) map[string]*time.Duration {
	out := make(map[string]*time.Duration, len(bpf.TimeoutKeys))
	for _, k := range bpf.TimeoutKeys {
		out[k.Name] = k.Of(t)
	}
	return out
}

func timeoutKeys() []string {
	return slices.Sorted(maps.Keys(timeoutFields(&bpf.Timeouts{})))
}

// parseTimeouts reads --nat-timeouts: KEY=DURATION pairs, separated by commas. The timeouts it
// leaves zero are the node's conntrack sysctls, or conntrack's defaults (bpf.ResolveTimeouts).
func parseTimeouts(s string) (bpf.Timeouts, error) {
	var t bpf.Timeouts
	fields := timeoutFields(&t)
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		field, known := fields[strings.TrimSpace(k)]
		if !ok || !known {
			return t, fmt.Errorf("nat-timeouts: %q: want KEY=DURATION with KEY one of %s", kv, strings.Join(timeoutKeys(), ", "))
		}
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil || d <= 0 {
			return t, fmt.Errorf("nat-timeouts: %q: want a positive duration such as 30s", kv)
		}
		*field = d
	}
	return t, nil
}
