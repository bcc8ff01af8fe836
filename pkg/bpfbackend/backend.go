// Package bpfbackend is the BPF datapath behind the agent's backend interface: it loads the SNAT
// engine (package bpf) with its maps pinned under <bpffs>/ip-masq-agent/v<layout>/ (migrating
// what an agent of an older layout pinned there, refusing a newer one's), attaches the programs
// to the uplinks (package tc), follows the uplinks and their addresses (package uplink), writes
// each policy into the maps and expires idle NAT entries. Installed reads what it pinned from
// another process (`dump`); Cleanup removes everything it installed.
package bpfbackend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/sandbox"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// Name is the backend's name on the command line.
const Name = "bpf"

// PinDir is the directory under the bpffs that holds the pins (the maps', in a directory per
// layout: bpf.LayoutDir), and LinkDir, under it, the tcx links' pins.
const (
	PinDir  = "ip-masq-agent"
	LinkDir = "links"
)

// Defaults of Options.
const (
	// DefaultSweepInterval keeps the NAT table close to its live flows: the shortest timeout
	// (ICMP, 30 s) is then overrun by a third at most.
	DefaultSweepInterval = 10 * time.Second
)

// Our tc filters (clsact mode): a fixed priority and handle, and the name prefix.
const (
	filterName     = "ip-masq-agent"
	filterPriority = 20000
	filterHandle   = 1
)

// Options configure a Backend.
type Options struct {
	// BPFFS is the mount point of a BPF filesystem (--bpffs).
	BPFFS string
	// Interfaces names the uplinks; empty means the devices of the default routes.
	Interfaces []string
	// AttachMode is tc.ModeTCX, tc.ModeTC, or "" / "auto" for the kernel's best (probed).
	AttachMode string
	// NATEntries sizes each family's confirmed NAT table (bpf.LoadOptions); zero is the default.
	NATEntries uint32
	// ReplaceNewer takes over the pins of a newer layout instead of refusing them
	// (bpf.OpenOptions.ReplaceNewer).
	ReplaceNewer bool
	// SweepInterval is how often idle NAT entries are removed; zero means the default.
	SweepInterval time.Duration
	// Timeouts are the idle timeouts of the sweep that --nat-timeouts sets: each one set
	// (nonzero) wins; the others are the node's own conntrack sysctls, read at every sweep, or
	// else conntrack's defaults (bpf.ResolveTimeouts).
	Timeouts bpf.Timeouts
	// ConntrackDir is where the node's conntrack sysctls are; empty means
	// bpf.ConntrackSysctlDir, those of the namespace the agent runs in.
	ConntrackDir string
	// Logger receives the backend's logs; nil discards them.
	Logger *slog.Logger
}

// Backend is the BPF datapath. Apply runs on the agent's loop; Counters, Info and the NAT
// reports may run at the same time (metric scrapes).
type Backend struct {
	opts Options
	// pinRoot is <bpffs>/ip-masq-agent, pinDir the maps' directory under it.
	pinRoot string
	pinDir  string
	mode    string
	// lacks is Info's Missing: it does not change while the agent runs.
	lacks   []string
	log     *slog.Logger
	attach  *tc.Manager
	resolve *uplink.Resolver
	// watchRes is the watcher's resolver: Apply gives it the policy's scope too.
	watchRes *uplink.Resolver
	changes  chan string

	// dp is nil until the first Apply loads the datapath (a bad configuration at startup thus
	// leaves the node as it was).
	dp atomic.Pointer[bpf.Datapath]

	stop func()
	wg   sync.WaitGroup

	mu      sync.Mutex // guards what Apply publishes for Info
	uplinks []uplink.Uplink
	// draining are the former uplinks that keep the programs while their flows last (former.go).
	draining []former
	// unsupported are the devices without an Ethernet header that the last Apply found pod
	// traffic routed through (uplink.Set.Unsupported).
	unsupported []uplink.Uplink
	refused     string // why the last load refused the pins (datapath.Info.Refused)

	// watched is what the uplink watcher read when it last saw the uplinks change, until an
	// Apply uses it instead of reading them again.
	watched atomic.Pointer[uplink.Set]

	// Only the agent's loop uses these.
	//
	// missing are the --interfaces devices the last Apply did not find.
	missing []string
	// lastApplied is the policy of the last successful Apply (uplinks are the uplinks it
	// attached to); applied tells that the last Apply succeeded, so that the node holds both:
	// what CheckDrift compares with.
	lastApplied *policy.Policy
	applied     bool
	// migration is the migration from older layouts' pins whose first pass the load did, until
	// an Apply has swapped the programs everywhere and finished it.
	migration *bpf.Migration

	// census is the last walk of the sweep's count of the NAT tables (sweep.go); sweepNow asks the
	// sweep loop for a walk at once.
	census   atomic.Pointer[census]
	sweepNow chan struct{}
	// largeTables, when not 0, replaces the const largeTables in counted (tests).
	largeTables int

	// hooks is what the drift checks found on each uplink's hooks (see checkHooks); guarded by
	// hookMu, as Hooks reads it for metric scrapes.
	hookMu sync.Mutex
	hooks  map[hookKey]*hookState
}

var (
	_ datapath.Backend      = (*Backend)(nil)
	_ datapath.InfoReporter = (*Backend)(nil)
	_ datapath.NATReporter  = (*Backend)(nil)
	_ datapath.Reader       = (*Backend)(nil)
	_ datapath.DriftChecker = (*Backend)(nil)
	_ datapath.HookReporter = (*Backend)(nil)
)

// New checks that the node can run the BPF datapath (a writable BPF filesystem, programs the
// kernel loads, a way to attach them), chooses the attach mode, and starts following the uplinks
// and sweeping the NAT table until ctx ends or Close. It installs nothing: the first Apply does.
func New(ctx context.Context, opts Options) (*Backend, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	log := opts.Logger.With("component", "bpf")
	if opts.SweepInterval <= 0 {
		opts.SweepInterval = DefaultSweepInterval
	}
	if err := bpf.CheckBPFFS(opts.BPFFS); err != nil {
		return nil, err
	}
	if err := probeLoad(); err != nil {
		return nil, err
	}
	mode := opts.AttachMode
	if err := tc.CheckMode(mode); err != nil {
		return nil, err
	}
	best, reason, err := tc.Probe()
	if err != nil {
		return nil, err
	}
	switch {
	case mode == "" || mode == tc.ModeAuto:
		mode = best
		log.Info("attach mode chosen", "mode", mode, "reason", reason)
	case mode == tc.ModeTCX && best != tc.ModeTCX:
		return nil, fmt.Errorf("--attach-mode=%s: %s", mode, reason)
	default:
		log.Info("attach mode chosen", "mode", mode, "reason", "--attach-mode")
	}
	lacks := Missing(best)
	if len(lacks) > 0 {
		log.Info("this kernel lacks features the datapath would use; it does without them", "missing", lacks)
	}
	pinRoot := filepath.Join(opts.BPFFS, PinDir)
	attach, err := tc.NewManager(mode, tcOptions(pinRoot, opts.Logger))
	if err != nil {
		return nil, err
	}
	res, err := uplink.NewResolver(opts.Interfaces)
	if err != nil {
		attach.Close()
		return nil, err
	}
	watchRes, err := uplink.NewResolver(opts.Interfaces)
	if err != nil {
		attach.Close()
		res.Close()
		return nil, err
	}
	b := &Backend{opts: opts, pinRoot: pinRoot, pinDir: bpf.LayoutDir(pinRoot), mode: mode, lacks: lacks, log: log,
		attach: attach, resolve: res, watchRes: watchRes, changes: make(chan string, 1),
		sweepNow: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(ctx)
	b.stop = cancel
	b.wg.Add(2)
	go func() {
		defer b.wg.Done()
		defer watchRes.Close()
		uplink.Watch(ctx, watchRes, b.uplinksChanged, opts.Logger)
	}()
	go func() {
		defer b.wg.Done()
		b.sweepLoop(ctx)
	}()
	return b, nil
}

// AttachOptions are how the backend attaches its programs under bpffs, and knows them again
// (what an agent of any layout did): for tests that install an earlier agent's datapath.
func AttachOptions(bpffs string, log *slog.Logger) tc.Options {
	return tcOptions(filepath.Join(bpffs, PinDir), log)
}

// tcOptions identify our attachments, for the backend and for cleanup. The links are pinned
// under the pin root, outside the layout directories: an agent of any layout swaps the programs
// of the same links.
func tcOptions(pinRoot string, log *slog.Logger) tc.Options {
	return tc.Options{LinkDir: filepath.Join(pinRoot, LinkDir), FilterName: filterName,
		FilterPriority: filterPriority, FilterHandle: filterHandle, Owns: bpf.Owns, Logger: log}
}

// probeLoad loads the programs once with tiny maps, pinning nothing: the kernel must accept them.
func probeLoad() error {
	dp, err := bpf.Load(bpf.LoadOptions{MaxRules: 8, NATEntries: 64, NATEntriesV6: 64, FragEntries: 64})
	if err != nil {
		err = sandbox.ExplainBPF(err)
		if _, denied := errors.AsType[*sandbox.DeniedError](err); denied {
			return err // the kernel never saw the programs
		}
		return fmt.Errorf("the kernel does not load the BPF programs: %w", err)
	}
	return dp.Close()
}

// Name implements datapath.Backend.
func (b *Backend) Name() string { return Name }

// Mode is the attach mode, tc.ModeTCX or tc.ModeTC.
func (b *Backend) Mode() string { return b.mode }

// Info implements datapath.InfoReporter.
func (b *Backend) Info() datapath.Info {
	b.mu.Lock()
	defer b.mu.Unlock()
	return datapath.Info{Backend: Name, AttachMode: b.mode, Details: details(b.pinDir, b.uplinks, b.draining), Refused: b.refused,
		Missing: b.lacks}
}

// Missing names the kernel features the datapath would use that this kernel lacks (probed;
// best is tc.Probe's mode), each with what it does instead (datapath.Info's Missing).
func Missing(best string) []string {
	var out []string
	if best != tc.ModeTCX {
		out = append(out, "tcx links (Linux 6.6): clsact qdiscs and cls_bpf filters in their place")
	}
	// Only a kernel without the helpers: any other error stops the load before this matters.
	if errors.Is(bpf.ClaimsUnsupported(), ebpf.ErrNotSupported) {
		out = append(out, bpf.ClaimsFallback)
	}
	return out
}

func details(pinDir string, ups []uplink.Uplink, draining []former) string {
	s := "maps pinned under " + pinDir
	if len(ups) > 0 {
		s += "; uplinks " + strings.Join(uplinkNames(ups), ", ")
	}
	if len(draining) > 0 {
		var names []string
		for _, f := range draining {
			names = append(names, f.String()+" "+f.note())
		}
		s += "; former uplinks draining " + strings.Join(names, ", ")
	}
	return s
}

func uplinkNames(ups []uplink.Uplink) []string {
	names := make([]string, len(ups))
	for i, u := range ups {
		names[i] = u.String()
	}
	return names
}

// Apply implements datapath.Backend: the policy into the maps (as a difference, new entries
// before stale ones are removed), then the uplinks' addresses, then the programs onto the
// uplinks (replacing an earlier process's in place), then what is left on devices that are no
// longer uplinks is removed, and then a migration from older pins is finished. Each step repairs
// drift: entries changed behind the agent's back are rewritten, programs detached behind its
// back are attached again.
//
// What the steps need of p is read from it here, once: the maps take p itself, the uplinks its
// scope and its masquerade addresses; the steps after them work on the datapath the maps step
// left in b.dp, and on the uplinks, and know nothing of policies.
func (b *Backend) Apply(ctx context.Context, p *policy.Policy) error {
	b.applied = false // until this apply succeeds
	// p is the policy in force on a resync, a retry, a drift repair.
	inForce := p.Equal(b.lastApplied)
	if err := b.syncMaps(p, inForce); err != nil {
		return err
	}
	set, err := b.resolveUplinks(ctx, p.MayMasquerade, inForce)
	if err != nil {
		return err
	}
	dp := b.dp.Load()
	b.mu.Lock()
	changed := !slices.Equal(b.uplinks, set.Uplinks)
	b.mu.Unlock()
	held := heldAddrs(set)
	if err := b.install(ctx, dp, masqueradingOf(p), set, held, changed); err != nil {
		return err
	}
	if err := b.dropStale(ctx, dp, set.Uplinks, held); err != nil {
		return err
	}
	if err := b.finishMigration(dp); err != nil {
		return err
	}
	b.lastApplied, b.applied = p, true
	b.mu.Lock()
	b.uplinks = set.Uplinks
	b.mu.Unlock()
	if changed {
		b.log.Info("programs attached", "mode", b.mode, "uplinks", uplinkNames(set.Uplinks))
	}
	return nil
}

// Counters implements datapath.Backend: the rules of the policy last synced (ruleCounters).
func (b *Backend) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	dp := b.dp.Load()
	if dp == nil {
		return nil, nil
	}
	return ruleCounters(ctx, dp, dp.Synced(), false)
}

// NATStats implements datapath.NATReporter: the tables' entries as the sweep's last walk counted
// them when they are large (sweep.go: counted), the datapath's counters as they are now.
func (b *Backend) NATStats(ctx context.Context) (datapath.NATStats, error) {
	dp := b.dp.Load()
	if dp == nil {
		return emptyStats(), nil
	}
	return natStats(ctx, dp, b.counted(dp))
}

// NATSummary implements datapath.NATReporter.
func (b *Backend) NATSummary(ctx context.Context, top int) (datapath.NATSummary, error) {
	dp := b.dp.Load()
	if dp == nil {
		return datapath.NATSummary{}, nil
	}
	return natSummary(ctx, dp, top)
}

// Cleanup implements datapath.Backend: everything the BPF backend installs under the bpffs it
// was given, and its programs on every device.
func (b *Backend) Cleanup(ctx context.Context) error {
	_, err := Cleanup(ctx, b.opts.BPFFS, b.opts.Logger)
	return err
}

// Close stops following the uplinks and sweeping, and releases descriptors. Programs, maps and
// links stay installed.
func (b *Backend) Close() error {
	b.stop()
	b.wg.Wait()
	var errs []error
	if dp := b.dp.Load(); dp != nil {
		errs = append(errs, dp.Close())
	}
	errs = append(errs, b.attach.Close())
	b.resolve.Close()
	return errors.Join(errs...)
}
