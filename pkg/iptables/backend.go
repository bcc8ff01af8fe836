package iptables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Name is the backend's name on the command line.
const Name = "iptables"

// probeChain is a throwaway chain used once to ask the kernel whether it accepts
// MASQUERADE --random-fully. It is removed right after.
const probeChain = "IP-MASQ-AGENT-PROBE"

// Options configure a Backend.
type Options struct {
	// Chain is the nat chain the policy lives in (--masq-chain); empty means DefaultChain.
	Chain string
	// Mode forces iptables-legacy or iptables-nft; empty detects it with DetectMode.
	Mode Mode
	// Runner runs the tools; nil means ExecRunner with DefaultTimeout.
	Runner Runner
	// Logger receives the backend's logs; nil discards them.
	Logger *slog.Logger
}

// Backend is the iptables datapath: the policy as one nat chain per family, hooked from
// POSTROUTING, and one more per source rule that holds sources of the family (Layout), each
// family applied with one iptables-restore --noflush transaction.
//
// Apply and Cleanup run on the agent's loop; Counters and Info may run at the same time (a
// metrics scrape), so what they share is guarded by mu.
type Backend struct {
	chain  string
	mode   Mode
	runner Runner
	log    *slog.Logger

	// randomFully caches, per family, whether the tools and the kernel accept --random-fully.
	// Only Apply uses it.
	randomFully map[policy.Family]bool
	// staleIPv6Checked is set once the first Apply without IPv6 removed what an earlier run
	// with --enable-ipv6 left behind. Only Apply uses it.
	staleIPv6Checked bool

	mu    sync.Mutex
	tools map[policy.Family]*tools
	// applied is, per family, the policy the last successful Apply installed (with the settings
	// the node could not honour dropped), for Counters. A published map is never modified.
	applied map[policy.Family]*policy.Policy
}

var (
	_ datapath.Backend      = (*Backend)(nil)
	_ datapath.InfoReporter = (*Backend)(nil)
)

// New returns a backend for the node: it chooses the iptables mode and checks that the IPv4
// tools are installed. It changes nothing.
func New(ctx context.Context, opts Options) (*Backend, error) {
	b := &Backend{chain: opts.Chain, mode: opts.Mode, runner: opts.Runner, log: opts.Logger,
		tools: map[policy.Family]*tools{}, randomFully: map[policy.Family]bool{}}
	if b.chain == "" {
		b.chain = DefaultChain
	}
	if err := ValidateChain(b.chain); err != nil {
		return nil, err
	}
	if b.runner == nil {
		b.runner = ExecRunner{}
	}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	b.log = b.log.With("component", "iptables")
	if b.mode == "" {
		choice, err := DetectMode(ctx, b.runner)
		if err != nil {
			return nil, err
		}
		b.mode = choice.Mode
		b.log.Info("iptables mode chosen", "mode", b.mode, "reason", choice.Reason)
	}
	if _, err := b.toolsFor(ctx, policy.IPv4); err != nil {
		return nil, err
	}
	return b, nil
}

// Name implements datapath.Backend.
func (b *Backend) Name() string { return Name }

// Mode is the iptables mode the backend uses.
func (b *Backend) Mode() Mode { return b.mode }

// Chain is the nat chain the backend manages.
func (b *Backend) Chain() string { return b.chain }

// Info implements datapath.InfoReporter: iptables attaches no programs.
func (b *Backend) Info() datapath.Info {
	return datapath.Info{Backend: Name, AttachMode: datapath.AttachNone,
		Details: fmt.Sprintf("iptables-%s, chain %s", b.mode, b.chain)}
}

func (b *Backend) toolsFor(ctx context.Context, fam policy.Family) (*tools, error) {
	b.mu.Lock()
	t, ok := b.tools[fam]
	b.mu.Unlock()
	if ok {
		return t, nil
	}
	// Resolved without the lock (it runs --version); two callers may both resolve, harmlessly.
	t, err := resolveTools(ctx, b.runner, b.mode, fam)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.tools[fam] = t
	b.mu.Unlock()
	return t, nil
}

// Apply implements datapath.Backend: per family, one iptables-restore --noflush --counters
// transaction that declares (and so flushes) the chains of the layout, refills them with the
// live counters of the lines that stay, removes the chains of source rules that went away and,
// when missing, adds the POSTROUTING jump. A family whose chains and jump are already exactly
// as wanted is left alone: rewriting it would lose the packets counted
// between reading the counters and the restore. With IPv6 disabled, the first Apply removes an
// IPv6 chain and jump left by an earlier run with --enable-ipv6, so that no stale IPv6 policy
// stays in force unmanaged.
func (b *Backend) Apply(ctx context.Context, p *policy.Policy) error {
	managed := []policy.Family{policy.IPv4}
	if p.Enabled(policy.IPv6) {
		managed = append(managed, policy.IPv6)
	} else {
		b.publish(policy.IPv6, nil)
		if !b.staleIPv6Checked {
			if err := b.removeStale(ctx, policy.IPv6); err != nil {
				// Not fatal: IPv6 is not managed, and the kernel may lack it altogether.
				b.log.Warn("could not remove a stale IPv6 chain", "error", err)
			}
			b.staleIPv6Checked = true
		}
	}
	for _, fam := range managed {
		fp := *p
		if fp.RandomFully {
			ok, err := b.supportsRandomFully(ctx, fam)
			if err != nil {
				return fmt.Errorf("apply %s chain %s: %w", fam, b.chain, err)
			}
			fp.RandomFully = ok
		}
		if err := b.applyFamily(ctx, &fp, fam); err != nil {
			return err
		}
		b.publish(fam, &fp)
	}
	return nil
}

// publish records the policy a family now holds (nil: none), for Counters and CheckDrift.
// Counters must match what is installed, also when a later family fails, and a scrape during
// Apply must see each family's current policy: so each family is published as soon as its
// transaction succeeded (datapath.Republished).
func (b *Backend) publish(fam policy.Family, p *policy.Policy) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.applied = datapath.Republished(b.applied, fam, p)
}

// eachApplied calls fn for each family the last Apply installed, in family order, with its
// policy and tools.
func (b *Backend) eachApplied(ctx context.Context, fn func(fam policy.Family, p *policy.Policy, t *tools) error) error {
	b.mu.Lock()
	applied := b.applied
	b.mu.Unlock()
	for _, fam := range policy.Families() {
		p, ok := applied[fam]
		if !ok {
			continue
		}
		t, err := b.toolsFor(ctx, fam)
		if err != nil {
			return err
		}
		if err := fn(fam, p, t); err != nil {
			return err
		}
	}
	return nil
}

func (b *Backend) applyFamily(ctx context.Context, p *policy.Policy, fam policy.Family) error {
	t, err := b.toolsFor(ctx, fam)
	if err != nil {
		return err
	}
	layout := Layout(p, fam, b.chain)
	nat, err := readChains(ctx, b.runner, t, true, layoutChains(layout, "POSTROUTING")...)
	if err != nil {
		return err
	}
	jumps := countJumps(nat.ChainRules("POSTROUTING"), b.chain)
	stale := staleChains(layout, nat.ChainRules(b.chain))
	if jumps == 1 && len(stale) == 0 && sameLayout(layout, nat) {
		b.log.Debug("chains unchanged; nothing to restore", "family", fam, "rules", len(p.Rules(fam)), "sourceRules", len(p.Sources))
		return nil
	}
	tx, kept := layoutTransaction(layout, jumps == 0, nat.Rules, stale)
	// Two agents overlapping in a rolling update may each have added the jump; keep one.
	for i := 1; i < jumps; i++ {
		tx.Delete(JumpRule(b.chain))
	}
	if err := b.restore(ctx, t, tx.Bytes(), "--counters"); err != nil {
		return fmt.Errorf("apply %s chain %s: %w", fam, b.chain, err)
	}
	b.log.Debug("chain applied", "family", fam, "rules", len(p.Rules(fam)), "sourceRules", len(p.Sources),
		"linesKeepingCounters", kept, "jumpAdded", jumps == 0, "staleChainsRemoved", len(stale))
	return nil
}

// layoutChains are the names of the layout's chains, after the extra ones.
func layoutChains(layout []Chain, extra ...string) []string {
	names := extra
	for _, c := range layout {
		names = append(names, c.Name)
	}
	return names
}

// staleChains are the source chains that the live main chain jumps to and the layout does not
// have: those of source rules that went away, each once.
func staleChains(layout []Chain, main []SavedRule) []string {
	var stale []string
	for _, r := range main {
		if isSourceChain(layout[0].Name, r.Target) && !slices.Contains(stale, r.Target) &&
			!slices.ContainsFunc(layout, func(c Chain) bool { return c.Name == r.Target }) {
			stale = append(stale, r.Target)
		}
	}
	return stale
}

// countJumps counts the rules of POSTROUTING that are the chain's jump.
func countJumps(postrouting []SavedRule, chain string) int {
	jump := JumpRule(chain).Spec()
	n := 0
	for _, r := range postrouting {
		if r.Spec == jump {
			n++
		}
	}
	return n
}

// sameLayout reports whether the live chains are exactly the rendered ones.
func sameLayout(layout []Chain, nat *Table) bool {
	live := nat.byChain()
	for _, c := range layout {
		if !nat.HasChain(c.Name) || !sameLines(c.Lines, live[c.Name]) {
			return false
		}
	}
	return true
}

// sameLines reports whether the live chain is exactly the rendered one.
func sameLines(lines []Line, live []SavedRule) bool {
	if len(lines) != len(live) {
		return false
	}
	for i := range lines {
		if lines[i].Rule.Spec() != live[i].Spec {
			return false
		}
	}
	return true
}

// save runs the family's iptables-save and returns its nat table.
func (b *Backend) save(ctx context.Context, t *tools, args ...string) (*Table, error) {
	out, err := b.runner.Run(ctx, nil, t.save, args...)
	if err != nil {
		return nil, fmt.Errorf("read nat table: %w", err)
	}
	return ParseSave(out, "nat")
}

var failedLineRE = regexp.MustCompile(`line:? (\d+)`)

// restore runs one iptables-restore --noflush transaction, with extra arguments such as
// --counters. Its error carries iptables' own message and, when iptables names a line, that
// line of the payload.
func (b *Backend) restore(ctx context.Context, t *tools, payload []byte, extra ...string) error {
	args := append([]string{"--noflush"}, extra...)
	if t.atLeast(1, 6, 2) {
		args = append(args, "--wait") // older restores have no --wait
	}
	_, err := b.runner.Run(ctx, payload, t.restore, args...)
	if err == nil {
		return nil
	}
	var ee *ExecError
	if errors.As(err, &ee) {
		if m := failedLineRE.FindStringSubmatch(ee.Stderr); m != nil {
			n, _ := strconv.Atoi(m[1])
			lines := strings.Split(string(payload), "\n")
			if n >= 1 && n <= len(lines) {
				return fmt.Errorf("%w (payload line %d: %s)", err, n, lines[n-1])
			}
		}
	}
	return err
}

// supportsRandomFully reports whether --random-fully can be used: iptables 1.6.2 or newer, and a
// kernel that accepts it, probed once per family with a throwaway chain. A probe that fails only
// says that the kernel rejects the option when the same rule without it goes through: otherwise
// iptables itself fails (a read-only xtables lock, say), which is returned, and the next call
// probes again.
func (b *Backend) supportsRandomFully(ctx context.Context, fam policy.Family) (bool, error) {
	if ok, done := b.randomFully[fam]; done {
		return ok, nil
	}
	t, err := b.toolsFor(ctx, fam)
	if err != nil {
		return false, nil // applyFamily reports the missing tools
	}
	if !t.atLeast(1, 6, 2) {
		b.log.Warn("iptables is older than 1.6.2 and has no --random-fully; masquerading without it",
			"family", fam, "tool", t.restore, "version", fmt.Sprintf("%d.%d.%d", t.version[0], t.version[1], t.version[2]))
		b.randomFully[fam] = false
		return false, nil
	}
	perr := b.probe(ctx, t, fam, true)
	if perr == nil {
		b.randomFully[fam] = true
		return true, nil
	}
	if ctx.Err() != nil {
		return false, ctx.Err() // cancelled: decide on a later call
	}
	if err := b.probe(ctx, t, fam, false); err != nil {
		return false, fmt.Errorf("probe MASQUERADE --random-fully: iptables fails without the option too: %w", err)
	}
	b.log.Warn("the kernel rejects MASQUERADE --random-fully; masquerading without it", "family", fam, "error", perr)
	b.randomFully[fam] = false
	return false, nil
}

// probe restores a throwaway chain holding one MASQUERADE rule, with --random-fully or
// without, and removes it. Its answer holds for SNAT too: the same kernel flag, in the same
// iptables release.
func (b *Backend) probe(ctx context.Context, t *tools, fam policy.Family, randomFully bool) error {
	probe := NewTransaction()
	probe.Declare(probeChain)
	probe.Append(Rule{Chain: probeChain, Jump: TargetMasquerade, RandomFully: randomFully})
	err := b.restore(ctx, t, probe.Bytes())
	// Remove the probe chain whatever happened; declaring it first makes the removal valid
	// even when the probe never created it.
	remove := NewTransaction()
	remove.Declare(probeChain)
	remove.DeleteChain(probeChain)
	if rerr := b.restore(ctx, t, remove.Bytes()); rerr != nil && err == nil {
		b.log.Warn("could not remove the --random-fully probe chain", "family", fam, "chain", probeChain, "error", rerr)
	}
	return err
}

// Counters implements datapath.Backend: the live counters of the chains (readChains), mapped
// back to the policy rules through the lines Render produced for them: the global lists' first,
// then each source rule's, in rule order. A source rule has counters in the families where it
// holds sources, the only ones where it has a chain.
func (b *Backend) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	var byList [][]datapath.RuleCounter
	err := b.eachApplied(ctx, func(fam policy.Family, p *policy.Policy, t *tools) error {
		layout := Layout(p, fam, b.chain)
		nat, err := readChains(ctx, b.runner, t, true, layoutChains(layout)...)
		if err != nil {
			return err
		}
		counters, _ := mapLines(layout, nat.Rules)
		byList = appendByList(byList, layout, counters)
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []datapath.RuleCounter
	for _, cs := range byList {
		out = append(out, cs...)
	}
	return out, nil
}

// appendByList adds a family's counters, per chain of its layout, to those of the families
// before it, by list: the global list's first (0), then each source rule's by its index (1+).
func appendByList(all [][]datapath.RuleCounter, layout []Chain, counters [][]datapath.RuleCounter) [][]datapath.RuleCounter {
	for i, c := range layout {
		at := 0
		if c.Source != nil {
			at = 1 + c.Source.Index
		}
		for len(all) <= at {
			all = append(all, nil)
		}
		all[at] = append(all[at], counters[i]...)
	}
	return all
}

// mapLines pairs the lines of the layout's chains with the live lines of those chains and sums
// the live counters per policy rule, per chain of the layout. Each rendered line takes the
// first unused live line of its chain with the same text, so duplicate rules each find their
// own line; a masquerade rule's address is its live lines' --to-source. A rule with any of its
// lines missing is not (fully) installed and is left out. rest are the indexes of the live
// lines that no reported rule and no line between the chains (a jump, a chain's final RETURN)
// took, in order.
func mapLines(layout []Chain, live []SavedRule) (counters [][]datapath.RuleCounter, rest []int) {
	pair := newPairing(live)
	taken := make([]bool, len(live))
	for _, c := range layout {
		cs, took := mapChain(c, live, pair)
		counters = append(counters, cs)
		for _, j := range took {
			taken[j] = true
		}
	}
	for j := range live {
		if !taken[j] {
			rest = append(rest, j)
		}
	}
	return counters, rest
}

// mapChain is mapLines for one chain: its rules' counters, and the live lines it took.
func mapChain(c Chain, live []SavedRule, pair pairing) (counters []datapath.RuleCounter, took []int) {
	match := make([]int, len(c.Lines))
	index := map[int]int{} // rule number -> position in counters
	missing := map[int]bool{}
	for i, l := range c.Lines {
		j := pair.take(c.Name, l.Rule.Spec())
		match[i] = j
		r := l.Policy
		if r == nil {
			continue
		}
		if j < 0 {
			missing[l.Number] = true
			continue
		}
		k, ok := index[l.Number]
		if !ok {
			k = len(counters)
			index[l.Number] = k
			counters = append(counters, datapath.RuleCounter{Set: r.Set, Family: r.Family, Rule: l.Number, Prefix: r.Prefix,
				Action: r.Action, Origin: r.Origin, Entry: r.Entry, Address: live[j].ToSource})
		}
		counters[k].Packets += live[j].Packets
		counters[k].Bytes += live[j].Bytes
	}
	kept := counters[:0]
	for _, rc := range counters {
		if !missing[rc.Rule] {
			kept = append(kept, rc)
		}
	}
	for i, l := range c.Lines {
		if j := match[i]; j >= 0 && (l.Policy == nil || !missing[l.Number]) {
			took = append(took, j)
		}
	}
	return kept, took
}

// Cleanup implements datapath.Backend: in both modes whose tools are installed and for both
// families, every rule that jumps to the chain is deleted and the chain removed, in one
// transaction per mode and family. Nothing to remove is not an error.
func (b *Backend) Cleanup(ctx context.Context) error {
	var errs []error
	for _, mode := range []Mode{b.mode, otherMode(b.mode)} {
		for _, fam := range policy.Families() {
			t, err := resolveTools(ctx, b.runner, mode, fam)
			if err != nil {
				b.log.Debug("no tools, nothing to clean up", "mode", mode, "family", fam)
				continue
			}
			if err := b.removeChains(ctx, t); err != nil {
				if mode == b.mode && fam == policy.IPv4 {
					errs = append(errs, fmt.Errorf("clean up %s %s: %w", mode, fam, err))
					continue
				}
				// The kernel may lack IPv6 or the other mode altogether.
				b.log.Warn("could not clean up", "mode", mode, "family", fam, "error", err)
			}
		}
	}
	b.mu.Lock()
	b.applied = nil
	b.mu.Unlock()
	return errors.Join(errs...)
}

// removeStale removes the chain of a family in the backend's own mode.
func (b *Backend) removeStale(ctx context.Context, fam policy.Family) error {
	t, err := resolveTools(ctx, b.runner, b.mode, fam)
	if err != nil {
		var missing *MissingToolsError
		if errors.As(err, &missing) {
			return nil // nothing can have been installed with tools that are not there
		}
		return err
	}
	return b.removeChains(ctx, t)
}

// removeChains deletes the rules that target the backend's chains (the policy chain, its source
// chains, those it jumps to and any left without a jump to them, and a leftover probe chain)
// and the chains themselves, in one transaction, if there are any. It finds the source chains
// by their names (SourceChain), so it needs no configuration. It reads the dump without -t so
// that a legacy table nobody uses is not created by reading it.
func (b *Backend) removeChains(ctx context.Context, t *tools) error {
	nat, err := b.save(ctx, t)
	if err != nil {
		return err
	}
	candidates := append([]string{b.chain, probeChain}, nat.SourceChains(b.chain)...)
	var removed []string
	for _, chain := range candidates {
		if nat.HasChain(chain) || len(nat.RulesTargeting(chain)) > 0 {
			removed = append(removed, chain)
		}
	}
	if len(removed) == 0 {
		return nil
	}
	tx := NewTransaction()
	jumps := 0
	for _, chain := range removed {
		for _, r := range nat.RulesTargeting(chain) {
			// The jumps from chains that go too go with their flush.
			if !slices.Contains(removed, r.Chain) {
				tx.DeleteSaved(r)
				jumps++
			}
		}
	}
	// Declaring a chain flushes it (or creates it, so that -X is valid either way); every chain
	// is flushed before any is removed, so that none is referenced by then.
	for _, chain := range removed {
		tx.Declare(chain)
	}
	for _, chain := range removed {
		tx.DeleteChain(chain)
	}
	if err := b.restore(ctx, t, tx.Bytes()); err != nil {
		return fmt.Errorf("remove chain %s: %w", strings.Join(removed, ", "), err)
	}
	b.log.Info("removed chain", "tool", t.restore, "chains", removed, "jumps", jumps)
	return nil
}

func otherMode(m Mode) Mode {
	if m == ModeNFT {
		return ModeLegacy
	}
	return ModeNFT
}
