package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"regexp"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// KeySourceRules is the list of source rules: pods chosen by address, namespace or labels whose
// traffic is decided by keys of their own.
const KeySourceRules = "sourceRules"

// Fields of a source rule besides the keys it overrides (RuleKeys).
const (
	ruleName              = "name"
	ruleCIDRs             = "cidrs"
	ruleNamespaceSelector = "namespaceSelector"
	rulePodSelector       = "podSelector"
)

// MaxSourceRules bounds the list: each rule is a set of tries in the BPF datapath and a chain
// in the others.
const MaxSourceRules = 1000

// RuleKeys are the keys a source rule may set for its sources; a key it leaves out is the
// global one.
var RuleKeys = []string{
	KeyNonMasqueradeCIDRs, KeyMasqueradeCIDRs, KeyMasqOutBound, KeyMasqOutBoundIPv6,
	KeyMasqLinkLocal, KeyMasqLinkLocalIPv6, KeyMasqueradeAddress, KeyMasqueradeAddressIPv6,
}

// ruleKeyRows are the rows of Keys of RuleKeys, in the order of Keys (set by init: Keys itself
// refers to this file's functions).
var ruleKeyRows []Key

func init() {
	for _, k := range Keys {
		if slices.Contains(RuleKeys, k.Name) {
			ruleKeyRows = append(ruleKeyRows, k)
		}
	}
}

func ruleKey(name string) (Key, bool) {
	i := slices.IndexFunc(ruleKeyRows, func(k Key) bool { return k.Name == name })
	if i < 0 {
		return Key{}, false
	}
	return ruleKeyRows[i], true
}

// SourceRule is a sourceRules entry: the sources it applies to, and the keys they are decided
// by instead of the global ones.
//
// A source is a pod address. It matches the rule when it lies in one of CIDRs, or when its pod
// is selected: in a namespace NamespaceSelector selects (any, without one) and with labels
// PodSelector selects (any, without one). The first rule that matches a source decides its
// traffic; a source no rule matches is decided by the global keys.
type SourceRule struct {
	Name  string
	CIDRs []netip.Prefix
	// NamespaceSelector and PodSelector are nil when absent; a rule with either selects pods
	// through the API server.
	NamespaceSelector, PodSelector *metav1.LabelSelector
	// Own holds the values of the keys in Set; its other fields are meaningless.
	Own Config
	Set []string
}

// Selects reports whether the rule chooses pods by labels (and so needs the API server).
func (r SourceRule) Selects() bool { return r.NamespaceSelector != nil || r.PodSelector != nil }

// Selectors returns the rule's selectors as label selectors: everything for an absent one.
// Only a validated rule's selectors are converted, so it cannot fail.
func (r SourceRule) Selectors() (namespaces, pods labels.Selector) {
	conv := func(s *metav1.LabelSelector) labels.Selector {
		if s == nil {
			return labels.Everything()
		}
		sel, err := metav1.LabelSelectorAsSelector(s)
		if err != nil {
			panic(fmt.Sprintf("source rule %s: selector %v passed validation: %v", r.Name, s, err))
		}
		return sel
	}
	return conv(r.NamespaceSelector), conv(r.PodSelector)
}

// Effective returns the configuration the rule's sources are decided by: global with the rule's
// own keys over it.
func (r SourceRule) Effective(global Config) Config {
	out := global
	out.SourceRules = nil
	for _, name := range r.Set {
		k, _ := ruleKey(name)
		k.copyFrom(&out, &r.Own)
	}
	return out
}

// Sets reports whether the rule sets key itself.
func (r SourceRule) Sets(key string) bool { return slices.Contains(r.Set, key) }

// canonical is the rule as a JSON mapping of the fields it has, in a fixed order.
func (r SourceRule) canonical() json.RawMessage {
	b := []byte{'{'}
	b = appendJSON(append(appendJSON(b, ruleName), ':'), r.Name)
	if r.CIDRs != nil {
		b = appendJSON(append(appendJSON(append(b, ','), ruleCIDRs), ':'), prefixStrings(r.CIDRs))
	}
	for _, s := range []struct {
		name string
		sel  *metav1.LabelSelector
	}{{ruleNamespaceSelector, r.NamespaceSelector}, {rulePodSelector, r.PodSelector}} {
		if s.sel == nil {
			continue
		}
		js, err := json.Marshal(s.sel)
		if err != nil {
			panic(fmt.Sprintf("marshal selector: %v", err))
		}
		b = append(append(appendJSON(append(b, ','), s.name), ':'), js...)
	}
	for _, k := range ruleKeyRows {
		if r.Sets(k.Name) {
			b = appendJSON(append(appendJSON(append(b, ','), k.Name), ':'), k.canonical(&r.Own))
		}
	}
	return append(b, '}')
}

func prefixStrings[P fmt.Stringer](ps []P) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}

// sourceRules is the sourceRules key.
func sourceRules(get func(*Config) *[]SourceRule) value {
	return field[[]SourceRule]{typ: "list of source rules", get: get,
		def: func(Options) []SourceRule { return nil }, parse: decodeSourceRules,
		toJSON: func(rs []SourceRule) any {
			out := make([]json.RawMessage, len(rs)) // never nil: an empty list is [], not null
			for i, r := range rs {
				out[i] = r.canonical()
			}
			return out
		}, join: joinSourceRules}
}

// joinSourceRules concatenates the files' rules; a rule an earlier file has already is dropped,
// and one of the same name that says something else is a conflict.
func joinSourceRules(have, got []SourceRule) ([]SourceRule, *conflict) {
	out := slices.Clone(have)
	for i, g := range got {
		j := slices.IndexFunc(have, func(h SourceRule) bool { return h.Name == g.Name })
		switch {
		case j < 0:
			out = append(out, g)
		case !bytes.Equal(have[j].canonical(), g.canonical()):
			return have, &conflict{Index: j, Entry: i, Have: string(have[j].canonical()), Got: string(g.canonical())}
		}
	}
	return out, nil
}

// RuleLabel names a rule in errors: its position and, once known, its name
// (sourceRules[2](batch)); a rule's field follows it after a dot.
func RuleLabel(i int, name string) string {
	if name == "" {
		return fmt.Sprintf("%s[%d]", KeySourceRules, i)
	}
	return fmt.Sprintf("%s[%d](%s)", KeySourceRules, i, name)
}

func decodeSourceRules(key string, raw json.RawMessage, opts Options) ([]SourceRule, error) {
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a list of rules, not " + describeJSON(raw),
			Hint: `for example [{name: batch, cidrs: ["10.244.8.0/21"], masqOutBound: false}]`}
	}
	var errs []error
	out := make([]SourceRule, 0, len(items))
	for i, item := range items {
		r, err := decodeSourceRule(i, item, opts)
		errs = append(errs, flatten(err)...)
		out = append(out, r)
	}
	return out, errors.Join(errs...)
}

// dnsLabel is what a rule's name may be: it is a label value of the metrics and part of chain
// and set names.
var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)

const maxRuleName = 40

func decodeSourceRule(i int, item json.RawMessage, opts Options) (SourceRule, error) {
	var r SourceRule
	var fields map[string]json.RawMessage
	if len(item) == 0 || item[0] != '{' || json.Unmarshal(item, &fields) != nil {
		return r, &FieldError{Key: KeySourceRules, Index: i, Value: display(item), Problem: "must be a mapping, not " + describeJSON(item),
			Hint: "write {name: batch, cidrs: [...], masqOutBound: false}"}
	}
	var errs []error
	if raw, ok := fields[ruleName]; !ok || string(raw) == "null" {
		errs = append(errs, &FieldError{Key: RuleLabel(i, ""), Index: -1, Value: display(item), Problem: "a rule without a name",
			Hint: "name it: name: batch"})
	} else if err := json.Unmarshal(raw, &r.Name); err != nil {
		errs = append(errs, &FieldError{Key: RuleLabel(i, "") + "." + ruleName, Index: -1, Value: display(raw), Problem: "must be a string, not " + describeJSON(raw)})
	} else if len(r.Name) > maxRuleName || !dnsLabel.MatchString(r.Name) {
		errs = append(errs, &FieldError{Key: RuleLabel(i, "") + "." + ruleName, Index: -1, Value: r.Name,
			Problem: fmt.Sprintf("must be at most %d lower-case letters, digits and '-', starting and ending with a letter or digit", maxRuleName)})
		r.Name = ""
	}
	label := RuleLabel(i, r.Name)
	for _, name := range slices.Sorted(maps.Keys(fields)) {
		raw := fields[name]
		if string(raw) == "null" {
			continue
		}
		at := label + "." + name
		switch name {
		case ruleName:
		case ruleCIDRs:
			ps, err := decodeCIDRs(at, raw, opts)
			errs = append(errs, flatten(err)...)
			r.CIDRs = ps
		case ruleNamespaceSelector, rulePodSelector:
			sel, err := decodeSelector(at, raw)
			if err != nil {
				errs = append(errs, err)
			}
			if name == ruleNamespaceSelector {
				r.NamespaceSelector = sel
			} else {
				r.PodSelector = sel
			}
		default:
			k, ok := ruleKey(name)
			if !ok {
				fe := &FieldError{Key: at, Index: -1, Value: name, Problem: "unknown key of a source rule"}
				names := append([]string{ruleName, ruleCIDRs, ruleNamespaceSelector, rulePodSelector}, RuleKeys...)
				if s := closestOf(name, names); s != "" {
					fe.Hint = fmt.Sprintf("did you mean %q?", s)
				} else {
					fe.Hint = "a rule takes " + strings.Join(names, ", ")
				}
				errs = append(errs, fe)
				continue
			}
			if err := k.decode(at, raw, opts, &r.Own); err != nil {
				errs = append(errs, flatten(err)...)
				continue
			}
			r.Set = append(r.Set, name)
		}
	}
	if r.CIDRs == nil && !r.Selects() && len(errs) == 0 {
		errs = append(errs, &FieldError{Key: label, Index: -1, Value: display(item), Problem: "a rule without sources",
			Hint: fmt.Sprintf("give it %s, a %s or a %s", ruleCIDRs, ruleNamespaceSelector, rulePodSelector)})
	}
	// In the order of Keys, whatever order the document wrote them in.
	slices.SortFunc(r.Set, func(a, b string) int {
		return slices.IndexFunc(ruleKeyRows, func(k Key) bool { return k.Name == a }) -
			slices.IndexFunc(ruleKeyRows, func(k Key) bool { return k.Name == b })
	})
	return r, errors.Join(errs...)
}

// decodeSelector reads a Kubernetes label selector (matchLabels, matchExpressions) and checks
// it as the API server would.
func decodeSelector(at string, raw json.RawMessage) (*metav1.LabelSelector, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var sel metav1.LabelSelector
	if err := dec.Decode(&sel); err != nil {
		return nil, &FieldError{Key: at, Index: -1, Value: display(raw), Problem: "not a label selector: " + err.Error(),
			Hint: "write {matchLabels: {team: batch}} or {matchExpressions: [{key: team, operator: In, values: [batch]}]}"}
	}
	if _, err := metav1.LabelSelectorAsSelector(&sel); err != nil {
		return nil, &FieldError{Key: at, Index: -1, Value: display(raw), Problem: "not a valid label selector: " + err.Error()}
	}
	return &sel, nil
}

// validateSourceRules checks the rules together and each rule's keys as the global keys are
// checked.
func (c Config) validateSourceRules() []error {
	var errs []error
	if n := len(c.SourceRules); n > MaxSourceRules {
		errs = append(errs, &FieldError{Key: KeySourceRules, Index: -1, Value: fmt.Sprintf("%d rules", n),
			Problem: fmt.Sprintf("more than %d rules", MaxSourceRules)})
	}
	for i, r := range c.SourceRules {
		if j := slices.IndexFunc(c.SourceRules[:i], func(o SourceRule) bool { return o.Name == r.Name }); j >= 0 && r.Name != "" {
			errs = append(errs, &FieldError{Key: RuleLabel(i, r.Name), Index: -1, Value: r.Name,
				Problem: fmt.Sprintf("the name of %s too", RuleLabel(j, r.Name)), Hint: "give every rule a name of its own"})
		}
		// The BPF datapath has one "none" address per uplink: the global masqueradeAddress when
		// there is one. A rule cannot ask for the uplink's primary address over it.
		for _, k := range []struct {
			key         string
			own, global netip.Addr
		}{{KeyMasqueradeAddress, r.Own.MasqueradeAddress, c.MasqueradeAddress},
			{KeyMasqueradeAddressIPv6, r.Own.MasqueradeAddressIPv6, c.MasqueradeAddressIPv6}} {
			if r.Sets(k.key) && !k.own.IsValid() && k.global.IsValid() {
				errs = append(errs, &FieldError{Key: RuleLabel(i, r.Name) + "." + k.key, Index: -1, Value: "",
					Problem: fmt.Sprintf("the uplink's primary address, while the global %s is %s", k.key, k.global),
					Hint:    "a rule leaves from the global masquerade address or an address of its own: name one, or leave the key out"})
			}
		}
		eff := r.Effective(c)
		for _, e := range eff.checks() {
			// The global keys' own errors are reported once, by checks.
			if fe, ok := errors.AsType[*FieldError](e); ok && r.Sets(fe.Key) {
				fe.Key = RuleLabel(i, r.Name) + "." + fe.Key
				errs = append(errs, e)
			}
		}
	}
	return errs
}

// SelectorRules tells which rules select pods by labels; the agent needs the API server for
// them. Nil when none does.
func (c Config) SelectorRules() []string {
	var out []string
	for _, r := range c.SourceRules {
		if r.Selects() {
			out = append(out, r.Name)
		}
	}
	return out
}
