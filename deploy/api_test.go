package deploy

import (
	"encoding/json"
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// keyNames are config.Keys' names, in order.
func keyNames() []string {
	var out []string
	for _, k := range config.Keys {
		out = append(out, k.Name)
	}
	return out
}

// The admission policies know the agent's keys, in its order, and nothing else: their list is
// config.Keys.
func TestAdmissionPoliciesKnowTheKeys(t *testing.T) {
	all := manifests(t)
	quoted := regexp.MustCompile(`'([A-Za-z0-9]+)'`)
	for _, path := range []string{"admission/configmap.yaml", "admission/ipmasqagentconfig.yaml"} {
		p, ok := all[path][0].(*admissionregistrationv1.ValidatingAdmissionPolicy)
		if !ok {
			t.Fatalf("%s: %T", path, all[path][0])
		}
		i := slices.IndexFunc(p.Spec.Variables, func(v admissionregistrationv1.Variable) bool { return v.Name == "known" })
		if i < 0 {
			t.Fatalf("%s: no variable known", path)
		}
		var got []string
		for _, m := range quoted.FindAllStringSubmatch(p.Spec.Variables[i].Expression, -1) {
			got = append(got, m[1])
		}
		if !slices.Equal(got, keyNames()) {
			t.Errorf("%s knows %q, the agent %q", path, got, keyNames())
		}
		// What a source rule takes, where the policy reads rules.
		if i := slices.IndexFunc(p.Spec.Variables, func(v admissionregistrationv1.Variable) bool { return v.Name == "ruleKnown" }); i >= 0 {
			var got []string
			for _, m := range quoted.FindAllStringSubmatch(p.Spec.Variables[i].Expression, -1) {
				got = append(got, m[1])
			}
			if want := ruleFields(); !slices.Equal(got, want) {
				t.Errorf("%s: a rule takes %q, the agent's %q", path, got, want)
			}
		} else if path == "admission/ipmasqagentconfig.yaml" {
			t.Errorf("%s: no variable ruleKnown", path)
		}
		if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionregistrationv1.Ignore {
			t.Errorf("%s: failurePolicy %v, want Ignore: the agent judges what the policy cannot", path, p.Spec.FailurePolicy)
		}
	}
}

// ruleFields are what a source rule takes, in the agent's order: its name and sources (as
// pkg/config names them in its messages), then the keys it may set.
func ruleFields() []string {
	return append([]string{"name", "cidrs", "namespaceSelector", "podSelector"}, config.RuleKeys...)
}

// keyTypes are the schema types of the kinds of Key.Type.
var keyTypes = map[string]string{"list of CIDRs": "array", "list of CIDRs or `{cidr, address}`": "array", "bool": "boolean",
	"int": "integer", "duration": "string", "address": "string", "list of source rules": "array"}

// The IPMasqAgentConfig's schema has a property for each key, of the key's type, and keeps
// unknown keys for the policy and the agent to refuse by name.
func TestConfigCRDIsTheKeys(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentconfigs.yaml")
	if crd.Name != kube.Configs.CRDName() || crd.Spec.Names.Kind != kube.Configs.Kind || crd.Spec.Scope != apiextensionsv1.ClusterScoped {
		t.Errorf("CRD %s of %s, %s; want %s of %s, cluster-scoped", crd.Name, crd.Spec.Names.Kind, crd.Spec.Scope, kube.Configs.CRDName(), kube.Configs.Kind)
	}
	spec := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
	if spec.XPreserveUnknownFields == nil || !*spec.XPreserveUnknownFields {
		t.Error("spec drops unknown keys: the agent would never see a misspelt one")
	}
	for _, k := range config.Keys {
		prop, ok := spec.Properties[k.Name]
		if !ok {
			t.Errorf("no property %s", k.Name)
			continue
		}
		if want := keyTypes[k.Type()]; prop.Type != want {
			t.Errorf("%s is of type %q, a %s wants %q", k.Name, prop.Type, k.Type(), want)
		}
	}
	if len(spec.Properties) != len(config.Keys) {
		t.Errorf("%d properties for %d keys", len(spec.Properties), len(config.Keys))
	}
}

// A source rule's schema has its name and sources, and each key it may set as the global key's
// schema has it; it refuses what the agent refuses of a name and of the list's length, keeps
// the list's order whole (the first matching rule decides), and keeps unknown fields in a rule
// and its selectors (a pruned one would change what the rule selects) for the policy and the
// agent to refuse by name.
func TestConfigCRDSourceRules(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentconfigs.yaml")
	spec := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
	list := spec.Properties[config.KeySourceRules]
	if list.MaxItems == nil || *list.MaxItems != config.MaxSourceRules {
		t.Errorf("sourceRules: maxItems %v, the agent takes %d", list.MaxItems, config.MaxSourceRules)
	}
	if list.XListType == nil || *list.XListType != "atomic" {
		t.Errorf("sourceRules: list type %v, want atomic: a merge must not reorder the rules", list.XListType)
	}
	if list.Items == nil || list.Items.Schema == nil {
		t.Fatal("sourceRules: no schema of a rule")
	}
	rule := *list.Items.Schema
	keeps := func(what string, s apiextensionsv1.JSONSchemaProps) {
		if s.XPreserveUnknownFields == nil || !*s.XPreserveUnknownFields {
			t.Errorf("%s drops unknown fields: the agent would never see a misspelt one", what)
		}
	}
	keeps("a rule", rule)
	for _, name := range config.RuleKeys {
		if !reflect.DeepEqual(rule.Properties[name], spec.Properties[name]) {
			t.Errorf("a rule's %s is %+v, the global key's %+v", name, rule.Properties[name], spec.Properties[name])
		}
	}
	if len(rule.Properties) != len(ruleFields()) {
		t.Errorf("a rule has %d properties, the agent's %d", len(rule.Properties), len(ruleFields()))
	}
	if !reflect.DeepEqual(rule.Properties["cidrs"], spec.Properties[config.KeyNonMasqueradeCIDRs]) {
		t.Errorf("a rule's cidrs are %+v, not a list of CIDRs", rule.Properties["cidrs"])
	}
	for _, name := range []string{"namespaceSelector", "podSelector"} {
		sel := rule.Properties[name]
		keeps(name, sel)
		exprs := sel.Properties["matchExpressions"]
		if sel.Properties["matchLabels"].AdditionalProperties == nil || exprs.Items == nil {
			t.Fatalf("%s is not a label selector: %+v", name, sel)
		}
		keeps(name+".matchExpressions[]", *exprs.Items.Schema)
		var ops []string
		for _, op := range exprs.Items.Schema.Properties["operator"].Enum {
			ops = append(ops, strings.Trim(string(op.Raw), `"`))
		}
		want := []string{string(metav1.LabelSelectorOpIn), string(metav1.LabelSelectorOpNotIn),
			string(metav1.LabelSelectorOpExists), string(metav1.LabelSelectorOpDoesNotExist)}
		if !slices.Equal(ops, want) {
			t.Errorf("%s's operators %q, a label selector's %q", name, ops, want)
		}
	}
	if !slices.Equal(rule.Required, []string{"name"}) {
		t.Errorf("a rule requires %q, the agent its name", rule.Required)
	}
	// The name's pattern and length are the agent's: it accepts exactly the names the schema does.
	nameSchema := rule.Properties["name"]
	pattern := regexp.MustCompile(nameSchema.Pattern)
	for _, name := range []string{"a", "batch", "partner-a", "0", "a-0", strings.Repeat("a", 40), strings.Repeat("a", 41),
		"Batch", "-a", "a-", "a_b", "a.b", "", "\u00e9"} {
		_, err := config.Parse(fmt.Appendf(nil, `{"sourceRules": [{"name": %q, "cidrs": ["10.0.0.0/8"]}]}`, name), config.Options{})
		schema := pattern.MatchString(name) && int64(len(name)) <= *nameSchema.MaxLength
		if schema != (err == nil) {
			t.Errorf("name %q: the schema takes it %v, the agent says %v", name, schema, err)
		}
	}
}

// The IPMasqAgentNode's schema describes kube.NodeStatus, field for field: what the agent writes
// is what the schema keeps (the API server prunes the rest).
func TestNodeCRDIsTheStatus(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentnodes.yaml")
	if crd.Name != kube.Nodes.CRDName() || crd.Spec.Names.Kind != kube.Nodes.Kind || crd.Spec.Scope != apiextensionsv1.ClusterScoped {
		t.Errorf("CRD %s of %s, %s", crd.Name, crd.Spec.Names.Kind, crd.Spec.Scope)
	}
	status := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"]
	checkSchema(t, "status", reflect.TypeFor[kube.NodeStatus](), status)
	for _, c := range crd.Spec.Versions[0].AdditionalPrinterColumns {
		if !strings.HasPrefix(c.JSONPath, ".status.") && !strings.HasPrefix(c.JSONPath, ".metadata.") {
			t.Errorf("column %s shows %s", c.Name, c.JSONPath)
		}
	}
}

// The IPMasqAgentConfig's status schema is the rollout controller's kube.ConfigObjectStatus.
func TestConfigCRDStatusIsTheRollout(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentconfigs.yaml")
	status := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"]
	checkSchema(t, "status", reflect.TypeFor[kube.ConfigObjectStatus](), status)
}

// checkSchema compares a Go type's JSON fields with an object schema's properties, recursively.
func checkSchema(t *testing.T, path string, typ reflect.Type, s apiextensionsv1.JSONSchemaProps) {
	t.Helper()
	if typ == reflect.TypeFor[json.RawMessage]() {
		return // any JSON: the schema says which
	}
	for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice {
		if typ.Kind() == reflect.Slice {
			if s.Items == nil || s.Items.Schema == nil {
				t.Errorf("%s: a list without items", path)
				return
			}
			s = *s.Items.Schema
		}
		typ = typ.Elem()
	}
	if typ.Kind() != reflect.Struct || typ.PkgPath() != reflect.TypeFor[kube.NodeStatus]().PkgPath() {
		return // a leaf, or metav1.Condition (the schema has its fields)
	}
	seen := map[string]bool{}
	for f := range typ.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		seen[name] = true
		prop, ok := s.Properties[name]
		if !ok {
			t.Errorf("%s: the schema has no %s", path, name)
			continue
		}
		checkSchema(t, path+"."+name, f.Type, prop)
	}
	for name := range s.Properties {
		if !seen[name] {
			t.Errorf("%s: the schema has %s, which the agent does not write", path, name)
		}
	}
}

// Both CRDs have the status subresource: the agent writes a node's status through it (and
// RBAC grants it there), and an IPMasqAgentConfig's generation counts its spec's changes only.
func TestCRDsHaveStatusSubresource(t *testing.T) {
	all := manifests(t)
	for _, path := range []string{"crds/ipmasqagentconfigs.yaml", "crds/ipmasqagentnodes.yaml"} {
		crd := one[*apiextensionsv1.CustomResourceDefinition](t, all, path)
		for _, v := range crd.Spec.Versions {
			if v.Subresources == nil || v.Subresources.Status == nil {
				t.Errorf("%s %s: no status subresource", path, v.Name)
			}
		}
	}
}

// Least privilege: each source's role reads its one object, the status role writes node statuses
// and reads Nodes, and nothing more.
func TestRBACIsLeast(t *testing.T) {
	all := manifests(t)
	rule := func(groups, resources, names, verbs []string) rbacv1.PolicyRule {
		return rbacv1.PolicyRule{APIGroups: groups, Resources: resources, ResourceNames: names, Verbs: verbs}
	}
	read := []string{"get", "list", "watch"}
	for path, want := range map[string][]rbacv1.PolicyRule{
		"rbac/configmap/role.yaml":  {rule([]string{""}, []string{"configmaps"}, []string{kube.DefaultConfigMapName}, read)},
		"rbac/crd/clusterrole.yaml": {rule([]string{kube.Group}, []string{kube.Configs.Plural}, []string{kube.DefaultConfigName}, read)},
		"rbac/status/clusterrole.yaml": {rule([]string{kube.Group}, []string{kube.Nodes.Plural}, nil, []string{"create", "patch"}),
			rule([]string{kube.Group}, []string{kube.Nodes.Plural + "/status"}, nil, []string{"patch"}), rule([]string{""}, []string{"nodes"}, nil, []string{"get"})},
		// --metrics-secure: the agent asks about its scrapers; a scraper gets /metrics.
		"rbac/metrics/clusterrole.yaml": {rule([]string{"authentication.k8s.io"}, []string{"tokenreviews"}, nil, []string{"create"}),
			rule([]string{"authorization.k8s.io"}, []string{"subjectaccessreviews"}, nil, []string{"create"})},
		"rbac/metrics/reader.yaml": {{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}},
		// Source rules' selectors: the node's pods (RBAC cannot say which node) and namespaces.
		"rbac/pods/clusterrole.yaml": {rule([]string{""}, []string{"pods", "namespaces"}, nil, []string{"list", "watch"})},
		// The rollout controller reads the object and writes its status, and reads the nodes'.
		"rbac/rollout/clusterrole.yaml": {
			rule([]string{kube.Group}, []string{kube.Configs.Plural}, []string{kube.DefaultConfigName}, []string{"get", "list", "watch", "patch"}),
			rule([]string{kube.Group}, []string{kube.Configs.Plural + "/status"}, []string{kube.DefaultConfigName}, []string{"update"}),
			rule([]string{kube.Group}, []string{kube.Nodes.Plural}, nil, read)},
	} {
		var got []rbacv1.PolicyRule
		switch r := all[path][0].(type) {
		case *rbacv1.Role:
			got = r.Rules
		case *rbacv1.ClusterRole:
			got = r.Rules
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s grants %+v, want %+v", path, got, want)
		}
	}
}
